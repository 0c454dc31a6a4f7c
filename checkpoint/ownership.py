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
import logging
import os
import stat
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from checkpoint.atomic_write import write_text
from checkpoint.confine import read_small
from checkpoint.dense import CheckpointError

OWNER = "OWNER"  # in the checkpoint folder: the owning run's id and directory
RUN_ID = "run_id"  # in the run directory: the run's id, made once
NEVER = "a run never prunes or overwrites another run's checkpoints"
META = "meta.json"  # a checkpoint's record (checkpoint.manager writes it): its run_id names the run that saved it
SMALL = 4096  # OWNER and run_id hold a few dozen bytes; anything larger is not one
META_LIMIT = 1 << 20  # a meta.json holds a model record and a data position: kilobytes
log = logging.getLogger("sluice")


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
        with open(path, "x", encoding="utf-8") as file:  # O_CREAT | O_EXCL: never through a link
            file.write(uuid.uuid4().hex + "\n")
    except FileExistsError:
        pass
    except OSError as error:
        raise CheckpointError(f"run directory {run_dir}: cannot write {RUN_ID} ({error.strerror}); a run needs a "
                              "writable run directory (hydra.run.dir)") from None
    run_id = read_small(path, f"run directory {run_dir}: {RUN_ID}", SMALL).strip()
    if not valid_id(run_id):
        raise CheckpointError(f"{path} holds no run id; delete it (a new one is made) or choose another hydra.run.dir")
    return Owner(run_id, str(Path(run_dir).resolve()))


def valid_id(run_id: object) -> bool:
    """A run id as `this_run` makes them: letters and digits, 1 to 64."""
    return isinstance(run_id, str) and 0 < len(run_id) <= 64 and run_id.isascii() and run_id.isalnum()


def read_owner(directory: Path) -> Owner | None:
    """The run recorded in `directory`'s OWNER, or None when the folder was never claimed."""
    path = Path(directory) / OWNER
    if not os.path.lexists(path):
        return None
    unreadable = (f"checkpoint.dir={directory}: {OWNER} is unreadable, so the run that owns these checkpoints is "
                  f"unknown; choose another checkpoint.dir (or, if they are this run's, delete {path})")
    try:
        record = json.loads(read_small(path, f"checkpoint.dir={directory}: {OWNER}", SMALL))
        owner = Owner(record["run_id"], record["run_dir"])
    except CheckpointError as error:
        raise CheckpointError(f"{error}; {unreadable.split('; ', 1)[1]}") from None
    except (ValueError, TypeError, KeyError, RecursionError):
        raise CheckpointError(unreadable) from None
    if not valid_id(owner.run_id) or not isinstance(owner.run_dir, str):
        raise CheckpointError(unreadable)
    return owner


def written_by(checkpoint: Path) -> str | None:
    """The run id a checkpoint's meta.json records (None: saved before checkpoints recorded it, or unreadable:
    reading it for its values is the loader's job, which names the problem)."""
    try:
        record = json.loads(read_small(Path(checkpoint) / META, "checkpoint", META_LIMIT))
    except (CheckpointError, ValueError, RecursionError):
        return None
    run_id = record.get(RUN_ID) if isinstance(record, dict) else None
    return run_id if valid_id(run_id) else None


def inside(path: Path | None, directory: Path) -> bool:
    """True when the checkpoint `path` lies directly in `directory`."""
    return path is not None and Path(path).resolve().parent == Path(directory).resolve()


def refusal(directory: Path, me: Owner, holdings: list[Path], resume_from: Path | None,
           explicit: bool) -> str | None:
    """One line when this run may not save into `directory` (holding the step folders `holdings`), else None.

    `resume_from` is the checkpoint this run resumed from, `explicit` whether checkpoint.resume named it. Without a
    readable OWNER the newest checkpoint's own record (meta.json's run_id) says whose the folder is."""
    writer = written_by(holdings[-1]) if holdings else None
    try:
        owner = read_owner(directory)
    except CheckpointError:
        if writer != me.run_id or not stat.S_ISREG(os.lstat(Path(directory) / OWNER).st_mode):
            raise  # a FIFO, device or link there is not an edit to repair: named, never replaced
        owner = None  # OWNER edited, but the checkpoints are this run's own: it is rewritten at the next save
    if owner is not None and owner.run_id == me.run_id:
        return None
    continues = inside(resume_from, directory) and (explicit or owner is None)
    if owner is None:
        if not holdings or writer == me.run_id:
            return None  # empty, or this run's own checkpoints (their meta.json records it) with OWNER lost
        if writer is not None:  # another run's, by their own record: only naming one continues them
            continues = inside(resume_from, directory) and explicit
        elif Path(directory).resolve().parent == Path(me.run_dir):
            continues = True  # an unclaimed folder of old checkpoints inside this run's own directory
        if continues:
            return None  # adopted by resuming
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
    run it took the folder over from, if another). A missing or unreadable OWNER over this run's own checkpoints is
    rewritten, with a warning."""
    if problem := refusal(directory, me, holdings, resume_from, explicit):
        return problem, None
    try:
        previous, lost = read_owner(directory), False
    except CheckpointError:
        previous, lost = None, True  # refusal let it through: the checkpoints are this run's own
    if previous is not None and previous.run_id == me.run_id:
        return None, None
    if previous is None and holdings and written_by(holdings[-1]) == me.run_id:
        log.warning("checkpoint.dir %s: %s was %s; rewritten from this run's own checkpoints (their meta.json "
                    "records run %s)", directory, OWNER, "unreadable" if lost else "missing", me.run_id)
    Path(directory).mkdir(parents=True, exist_ok=True)
    target = Path(directory) / OWNER
    text = json.dumps({"run_id": me.run_id, "run_dir": me.run_dir}, indent=1) + "\n"
    if previous is not None or lost:
        write_text(target, text, f"checkpoint.dir={directory}: {OWNER}")  # old or new, never half; never a link
        return None, previous
    fd, tmp = tempfile.mkstemp(prefix=f".{OWNER}.", suffix=".tmp", dir=directory)  # exclusive, never a link
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
    os.chmod(tmp, 0o644)
    try:
        os.link(tmp, target)  # a first claim: exclusive, so of two runs starting at once only one gets the folder
    except FileExistsError:
        return refusal(directory, me, holdings, resume_from, explicit), None
    finally:
        os.unlink(tmp)
    return None, None
