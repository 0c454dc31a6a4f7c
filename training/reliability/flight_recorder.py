"""NCCL's flight recorder: each rank's last collectives and P2P ops, kept in a ring, written into the run directory.

Only NCCL keeps one (gloo has none, and on CPU runs nothing here does anything). A worker turns it on before its
process group exists and points NCCL's own dumps (on NCCL's timeout) into `hang/`; the watchdog, which ends a hung
rank before NCCL's longer timeout would, writes the same trace itself beside the rank's hang dump. Read them with
`python -m torch.distributed.flight_recorder.fr_trace <run dir>/hang --prefix nccl_trace_rank_`.
"""

import os
from collections.abc import MutableMapping
from pathlib import Path

import torch

from checkpoint.atomic_write import write_bytes
from checkpoint.errors import CheckpointError
from training.reliability.hang import DUMP_DIR

PREFIX = "nccl_trace_rank_"
ENTRIES = 2000  # per rank: a step of a deep pipeline holds a few hundred P2P ops and collectives
BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch's name now, and the one before it


def enable(run_dir: Path, backend: str, env: MutableMapping[str, str] = os.environ) -> None:
    """Record NCCL's ops from the process group's creation on, dumps into `run_dir`/hang (a user's settings win)."""
    if backend != "nccl":
        return
    folder = Path(run_dir) / DUMP_DIR
    folder.mkdir(parents=True, exist_ok=True)  # NCCL opens the file, it does not make the folder
    for name in BUFFER_SIZE:
        env.setdefault(name, str(ENTRIES))
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / PREFIX))
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def dump(run_dir: Path | None, rank: int) -> Path | None:
    """Write this rank's NCCL trace into the run directory now; None where there is none (no NCCL, recorder off)."""
    trace = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)  # only in builds with NCCL
    if run_dir is None or trace is None or not any(os.environ.get(name) for name in BUFFER_SIZE):
        return None
    try:
        data = trace()
    except Exception:  # noqa: BLE001  no NCCL group in this process, or one already torn down: nothing to add
        return None
    path = Path(run_dir) / DUMP_DIR / f"{PREFIX}{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_bytes(path, data, "NCCL trace")  # never through a link planted in the run directory
    except CheckpointError:
        return None
    return path
