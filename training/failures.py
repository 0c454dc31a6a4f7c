"""Worker failures as one line: known errors by their message, others with a traceback in the rank's log file.

A failing rank writes `failures/rank{R}.json` (its line and the time) into the run directory; the self-launch
root prints the earliest one, once. Under torchrun (no launcher of ours) each failing rank prints its line.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from tqdm import tqdm

# The project's own error classes (ConfigError, CheckpointError, DataError, TransportTimeout, BoundaryMismatch,
# ScheduleError, InjectedCrash, NonFiniteError, ...) exist to carry a message that says what is wrong and how to
# fix it: those are printed as they are. Anything else is unexpected and keeps its traceback.
PROJECT_PACKAGES = ("minimind", "parallel", "checkpoint", "training")
FAILURE_DIR = "failures"
LOG_DIR = "logs"


def is_known(error: BaseException) -> bool:
    """True for an error class defined by this project (its message is written for the user)."""
    return type(error).__module__.split(".")[0] in PROJECT_PACKAGES


def describe_failure(error: BaseException, run_dir: Path, rank: int) -> str:
    """One line for `error`; an unexpected one also writes its traceback to logs/rank{R}.log (path in the line)."""
    text = " ".join(str(error).split()) or type(error).__name__
    if is_known(error):
        return text if text.startswith(f"rank {rank}:") else f"rank {rank}: {text}"  # P2P errors name their rank
    path = Path(run_dir) / LOG_DIR / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as log:
        log.write("".join(traceback.format_exception(error)))
    return f"rank {rank}: unexpected {type(error).__name__}: {text} (traceback in {path})"


def record_failure(run_dir: Path, rank: int, message: str, announce: bool) -> None:
    """Leave the line for the launcher; print it too when no launcher of ours will."""
    path = Path(run_dir) / FAILURE_DIR / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():  # the first failure of a rank is the cause; later ones are consequences
        path.write_text(json.dumps({"rank": rank, "time": time.time(), "message": message}))
    if announce:  # through tqdm: a progress bar on the screen is cleared first, not glued to the line
        tqdm.write(f"sluice: {message}", file=sys.stderr)
        sys.stderr.flush()


def first_failure(run_dir: Path) -> str | None:
    """The earliest failure line any rank left, or None."""
    records = []
    for path in (Path(run_dir) / FAILURE_DIR).glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return min(records, key=lambda r: r["time"])["message"] if records else None
