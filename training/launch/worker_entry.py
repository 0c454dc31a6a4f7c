"""A self-launched worker process: `python training/launch/worker_entry.py CONFIG_JSON RUN_DIR`, started by the launcher.

Self-launch starts its workers as plain subprocesses of this script rather than multiprocessing children of a
Python function: multiprocessing (spawn) keeps named semaphores in /dev/shm for each worker's result queue,
which a SIGKILL of the whole process group (scancel, an OOM kill) leaves behind forever. A worker reports through
the run directory anyway, so it needs no result queue.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, from any working directory

if __name__ == "__main__":
    import gc

    from training.launch.workers import worker_main

    gc.freeze()  # as train.py: the imports' objects live as long as the process, so the collector skips them
    worker_main(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
