"""Worker failures as one line: known errors by their message, others with a traceback in the rank's log file.

A failing rank writes `failures/rank{R}.json` (its line and the time) into the run directory; the self-launch
root prints the earliest one, once. Under torchrun (no launcher of ours) each failing rank prints its line.
"""

import json
import sys
import time
import traceback
from pathlib import Path

from tqdm import tqdm

from checkpoint.atomic_write import open_append, write_text
from checkpoint.errors import CheckpointError
from training.reliability.hang import read_records

# The project's own error classes (ConfigError, CheckpointError, DataError, TransportTimeout, BoundaryMismatch,
# ScheduleError, InjectedCrash, NonFiniteError, ...) exist to carry a message that says what is wrong and how to
# fix it: those are printed as they are. Anything else is unexpected and keeps its traceback.
PROJECT_PACKAGES = ("minimind", "parallel", "checkpoint", "training")
FAILURE_DIR = "failures"
LOG_DIR = "logs"


def is_known(error: BaseException) -> bool:
    """True for an error class defined by this project (its message is written for the user)."""
    return type(error).__module__.split(".")[0] in PROJECT_PACKAGES


def describe_failure(error: BaseException, run_dir: Path | None, rank: int) -> str:
    """One line for `error`; an unexpected one also writes its traceback to logs/rank{R}.log (path in the line).
    `run_dir` None: not known yet (a torchrun rank >= 1 before rank 0 told it), nothing is written."""
    text = " ".join(str(error).split()) or type(error).__name__
    if is_known(error):
        return text if text.startswith(f"rank {rank}:") else f"rank {rank}: {text}"  # P2P errors name their rank
    if run_dir is None:
        return f"rank {rank}: unexpected {type(error).__name__}: {text} (before the run directory was known)"
    path = Path(run_dir) / LOG_DIR / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open_append(path, "traceback log") as log:
            log.write("".join(traceback.format_exception(error)))
    except CheckpointError as refused:  # a link planted in the run directory: the line still says what failed
        return f"rank {rank}: unexpected {type(error).__name__}: {text} ({refused})"
    return f"rank {rank}: unexpected {type(error).__name__}: {text} (traceback in {path})"


def record_failure(run_dir: Path | None, rank: int, message: str, announce: bool, culprit: int | None = None,
                   kind: str | None = None) -> None:
    """Leave the line for the launcher (with the rank the heartbeats blame, if any); print it too when no
    launcher of ours will. Only ever into the run directory: with `run_dir` None (not known yet) it is printed."""
    path = None if run_dir is None else Path(run_dir) / FAILURE_DIR / f"rank{rank}.json"
    if path is not None and not path.exists():  # the first failure of a rank is the cause; later: consequences
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"rank": rank, "time": time.time(), "message": message, "culprit": culprit, "kind": kind}
        try:
            write_text(path, json.dumps(record), "failure record")  # renamed into place: never half a record
        except CheckpointError:
            announce = True  # a link planted where the record goes: the line is printed instead
    if announce:  # through tqdm: a progress bar on the screen is cleared first, not glued to the line
        tqdm.write(f"sluice: {message}", file=sys.stderr)
        sys.stderr.flush()


def read_failures(run_dir: Path) -> list[dict]:
    """Every failure record the ranks left, earliest first."""
    return read_records(Path(run_dir) / FAILURE_DIR, "failure record", "time", (int, float))


def first_failure(run_dir: Path, killed: dict[int, str] | None = None) -> str | None:
    """The cause of a failed group, as one line: the rank the heartbeats blame (its own line where it left one), a rank
    killed by a signal (`killed`: rank -> signal name, as its launcher saw it), else the earliest line. A rank the
    heartbeats saw stalled comes before the launcher's word (a stalled rank is ended by SIGKILL: "stalled at step 7"
    says more than "died (SIGKILL)"). A rank they saw dead comes after it: the launcher saw which rank a signal ended
    before it stopped the others, where a peer reading the heartbeats may find those others gone too."""
    records = read_failures(run_dir)
    own = {r["rank"]: r for r in records}
    blamed = [r for r in records if r.get("culprit") is not None]
    if blamed:
        culprit = blamed[0]["culprit"]
        if culprit in own and own[culprit].get("culprit") in (None, culprit):
            return own[culprit]["message"]  # it failed itself (a crash): its words, not its peers' guess
        if blamed[0].get("kind") != "died":
            return blamed[0]["message"]
    for rank, signal in sorted((killed or {}).items()):
        if rank not in own:
            return f"rank {rank} died ({signal})"
    return blamed[0]["message"] if blamed else records[0]["message"] if records else None
