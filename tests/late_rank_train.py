"""`torchrun ... tests/late_rank_train.py train.py OVERRIDES`: train.py, except that rank 1 of a restarted group joins
only once rank 0 is in the rendezvous, as a replaced node or a slow import makes it arrive last. That order is the
one that failed: torchrun keeps its store across --max-restarts, and a restarted rank 0 that looks first reads the
gloo address its dead peer published in the previous start ("Gloo connectFullMesh ... Connection refused")."""

import json
import os
import runpy
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOINING = "start-up: joining the process group"  # rank 0's phase in its heartbeat (training/launch.py)

if __name__ == "__main__":
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("RANK") == "1" and restart != "0":
        import torch.distributed as dist

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=60))
        key = f"sluice/heartbeat/{restart}/0"  # training/reliability/heartbeat.py: this start's beats of rank 0
        deadline = time.monotonic() + 120  # a bound, not a pace: the wait ends when rank 0 says it is joining
        while time.monotonic() < deadline and not (
                store.check([key]) and json.loads(store.get(key))["what"] == JOINING):
            time.sleep(0.1)
    sys.path.insert(0, str(ROOT))
    sys.argv = sys.argv[1:]  # train.py and its overrides, as torchrun would have started them
    runpy.run_path(sys.argv[0], run_name="__main__")
