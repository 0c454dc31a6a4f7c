"""Who owns a checkpoint folder: a run never prunes, cleans or overwrites what another run saved.

A run is its run directory (Hydra's output dir, one per run for all ranks). Its id is made once, at random, into
`<run dir>/run_id`, so every start of the run reads the same id back: a self-launch restart
(`train.max_restarts`), a `torchrun --max-restarts` restart (the documented recipe fixes `hydra.run.dir`) and a
later `checkpoint.resume=auto` into the same run directory are one owner; a fresh run (a new, timestamped run
directory) or another job of a sweep is another. The first save into `checkpoint.dir` claims it: `OWNER` there
names the run's id and directory. Ownership is per folder, not per checkpoint: only the owner saves, prunes
(`keep_last`) and removes stale `.step_*.tmp` there, so everything in the folder is its own history.

A run that resumes from a checkpoint inside another run's folder, named explicitly (`checkpoint.resume=<path>`),
is that run's continuation: its first save takes the folder over (OWNER names it from then on, and the earlier
run's checkpoints count towards its `keep_last`); the earlier run, if it still runs, is refused at its next save.
`checkpoint.resume=auto` means "this run's own checkpoints" and never takes over another run's folder. A folder
with checkpoints but no OWNER (saved before runs claimed folders) belongs to the run directory it lies in, and is
adopted by a run that resumes from it.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from checkpoint.dense import CheckpointError

OWNER = "OWNER"  # in the checkpoint folder: the owning run's id and directory
RUN_ID = "run_id"  # in the run directory: the run's id, made once
NEVER = "a run never prunes or overwrites another run's checkpoints"


@dataclass(frozen=True)
class Owner:
    """A run as a checkpoint folder records it."""

    run_id: str
    run_dir: str


def this_run(run_dir: Path) -> Owner:
    """The run of `run_dir`: its id read back, or made now (exclusively: two processes agree on one id)."""
    path = Path(run_dir) / RUN_ID
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(path, "x", encoding="utf-8") as file:
            file.write(uuid.uuid4().hex + "\n")
    except FileExistsError:
        pass
    except OSError as error:
        raise CheckpointError(f"run directory {run_dir}: cannot write {RUN_ID} ({error.strerror}); a run needs a "
                              "writable run directory (hydra.run.dir)") from None
    run_id = path.read_text(encoding="utf-8").strip()
    if not run_id or len(run_id) > 64 or not run_id.isalnum():
        raise CheckpointError(f"{path} holds no run id; delete it (a new one is made) or choose another hydra.run.dir")
    return Owner(run_id, str(Path(run_dir).resolve()))


def read_owner(directory: Path) -> Owner | None:
    """The run recorded in `directory`'s OWNER, or None when the folder was never claimed."""
    path = Path(directory) / OWNER
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return Owner(str(record["run_id"]), str(record["run_dir"]))
    except (OSError, ValueError, TypeError, KeyError):
        raise CheckpointError(f"checkpoint.dir={directory}: {OWNER} is unreadable, so the run that owns these "
                              f"checkpoints is unknown; choose another checkpoint.dir (or, if they are this run's, "
                              f"delete {path})") from None


def inside(path: Path | None, directory: Path) -> bool:
    """True when the checkpoint `path` lies directly in `directory`."""
    return path is not None and Path(path).resolve().parent == Path(directory).resolve()


def refusal(directory: Path, me: Owner, holdings: list[Path], resume_from: Path | None,
            explicit: bool) -> str | None:
    """One line when this run may not save into `directory` (holding the step folders `holdings`), else None.

    `resume_from` is the checkpoint this run resumed from, `explicit` whether checkpoint.resume named it."""
    owner = read_owner(directory)
    if owner is not None and owner.run_id == me.run_id:
        return None
    continues = inside(resume_from, directory) and (explicit or owner is None)
    if owner is None:
        if not holdings or continues or Path(directory).resolve().parent == Path(me.run_dir):
            return None  # empty, adopted by resuming, or an unclaimed folder inside this run's own directory
        return (f"checkpoint.dir={directory} holds checkpoints ({holdings[-1].name}) that this run did not write; "
                f"{NEVER}: choose another checkpoint.dir, or continue them: checkpoint.resume={holdings[-1]}")
    if continues:
        return None  # the continuation of the owner: its first save takes the folder over
    alternative = (f", or continue that run here by naming its checkpoint: checkpoint.resume={holdings[-1]} "
                   "(resume=auto continues only this run's own)") if holdings else ""
    return f"checkpoint.dir={directory} belongs to another run ({owner.run_dir}); {NEVER}: choose another " \
           f"checkpoint.dir{alternative}"


def claim(directory: Path, me: Owner, holdings: list[Path], resume_from: Path | None,
          explicit: bool) -> tuple[str | None, Owner | None]:
    """Make `me` the owner of `directory` (created) unless `refusal` says no: (the refusal, None), or (None, the
    run it took the folder over from, if another)."""
    if problem := refusal(directory, me, holdings, resume_from, explicit):
        return problem, None
    previous = read_owner(directory)
    if previous is not None and previous.run_id == me.run_id:
        return None, None
    Path(directory).mkdir(parents=True, exist_ok=True)
    tmp, target = Path(directory) / f".{OWNER}.{me.run_id}.tmp", Path(directory) / OWNER
    tmp.write_text(json.dumps({"run_id": me.run_id, "run_dir": me.run_dir}, indent=1) + "\n", encoding="utf-8")
    if previous is not None:
        os.replace(tmp, target)  # a takeover: a reader sees the old owner or the new one, never half a file
        return None, previous
    try:
        os.link(tmp, target)  # a first claim: exclusive, so of two runs starting at once only one gets the folder
    except FileExistsError:
        return refusal(directory, me, holdings, resume_from, explicit), None
    finally:
        tmp.unlink(missing_ok=True)
    return None, None
