"""Checkpoint folders of a run: `step_<N>` names, atomic completion, keep_last, resume=auto|none|<path>.

A save writes into `.step_<N>.tmp`, then global rank 0 adds `meta.json` (step, data position, model and
layout), the files' checksums (`SHA256SUMS`, checked on load) and the `COMPLETE` marker, and renames the folder:
only complete checkpoints ever carry the visible name, so a save killed half-way is never loaded. A run saves,
prunes and cleans only in a folder it owns (checkpoint.ownership); a full or read-only disk ends the save on
every rank with one line naming the folder and the space needed (checkpoint.disk). Every rank must see the same
directory (a shared file system on several nodes), as DCP's file-system storage requires.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from checkpoint.compat import keep_written_config
from checkpoint.confine import inside
from checkpoint.checksums import SUMS, digest, sums_text
from checkpoint.dense import CheckpointError
from checkpoint.disk import space_problem, write_problem
from checkpoint.distributed import TrainingState, check_finite, load_state, read_keys, save_state
from checkpoint.atomic_write import write_text
from checkpoint.ownership import OWNER, RUN_ID, Owner, claim, read_owner, refusal, this_run
from checkpoint.meta_schema import step_problem, checked_meta
from parallel.collectives import broadcast_object

log = logging.getLogger("sluice")
COMPLETE, META, TOKENIZER = "COMPLETE", "meta.json", "tokenizer"
STEP_DIR = re.compile(r"step_(\d+)")


class Stateful(Protocol):
    """The data stream's resume position (JSON-serialisable, layout-free)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and when to save, and what to resume from (`auto`, `none` or a path)."""

    dir: Path
    every: int
    keep_last: int
    resume: str
    save_final: bool
    model_keys: tuple[str, ...] = ()  # the model fields a run sets: named first when a checkpoint's model differs
    run_dir: Path | None = None  # the run's directory: who the run is, for owning `dir` (checkpoint.ownership)

    @property
    def saves(self) -> bool:
        """True when the run writes checkpoints at all."""
        return self.every > 0 or self.save_final


def is_complete(path: Path) -> bool:
    """A finished checkpoint: visible name, completion marker and meta.json."""
    return STEP_DIR.fullmatch(path.name) is not None and (path / COMPLETE).is_file() and (path / META).is_file()


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first; a `step_N` link is not one of them (resuming, pruning
    or taking over through it would reach another folder)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and not p.is_symlink() and is_complete(p)]
    return sorted(found, key=_step)


def find_checkpoint(path: Path) -> Path | None:
    """`path` itself if it is a complete checkpoint, else the newest one in it or in its `checkpoints/`."""
    path = Path(path)
    if is_complete(path):
        return path
    for directory in (path, path / "checkpoints"):
        found = complete_checkpoints(directory)
        if found:
            return found[-1]
    return None


def read_meta(path: Path) -> dict[str, Any]:
    """The meta.json of a complete checkpoint, checked against its schema (`meta_schema`) before any value is used."""
    file = inside(Path(path), META, "checkpoint")  # a link out of the checkpoint or a FIFO: refused, never read
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: arrays nested past Python's stack
        raise CheckpointError(f"checkpoint {path}: unreadable {META} ({type(error).__name__}); the checkpoint is "
                              "corrupt: resume from another one") from None
    return checked_meta(raw, Path(path))


def model_mismatch(path: Path, saved: dict[str, Any], current: dict[str, Any],
                   settable: tuple[str, ...] = ()) -> str | None:
    """One line naming the first model field where the checkpoint and this run differ, or None; fields a run sets
    come before the ones derived from them (hidden_size before head_dim)."""
    for key in sorted(set(saved) | set(current), key=lambda k: (k not in settable, k)):
        if key != "name" and saved.get(key) != current.get(key):
            return (f"checkpoint {path} was written for model.{key}={saved.get(key)} but this run has "
                    f"model.{key}={current.get(key)}; use the checkpoint's model settings or checkpoint.resume=none")
    return None


LORA_CHECKED = ("rank", "alpha", "targets", "dropout")  # what a resumed run must share (not the base's path)


def lora_mismatch(path: Path, saved: dict[str, Any] | None, current: dict[str, Any] | None) -> str | None:
    """One line naming the first LoRA setting where the checkpoint and this run differ (no record: lora.rank=0)."""
    saved, current = saved or {"rank": 0}, current or {"rank": 0}
    for key in LORA_CHECKED:
        if saved.get(key) != current.get(key):
            return (f"checkpoint {path} was written with lora.{key}={saved.get(key)} but this run has "
                    f"lora.{key}={current.get(key)}; use the checkpoint's lora settings or checkpoint.resume=none")
    return None


def resolve_resume(resume: str, directory: Path) -> Path | None:
    """The checkpoint `resume` names: None for `none` or an `auto` without any; raise for a bad path."""
    if resume in ("none", "", None):
        return None
    if resume == "auto":
        if os.path.islink(directory):  # resume=auto means this run's own checkpoints: a link may lead to any run's
            raise CheckpointError(f"checkpoint.resume=auto: checkpoint.dir={directory} is a symbolic link (to "
                                  f"{os.path.realpath(directory)}); auto resumes only this run's own checkpoints, "
                                  "never through a link: name the checkpoint, checkpoint.resume=<its folder>")
        found = complete_checkpoints(directory)
        return found[-1] if found else None
    if not Path(resume).exists():
        raise CheckpointError(f"checkpoint.resume={resume} does not exist; give a checkpoint, a checkpoints folder "
                              "or a run directory, or use checkpoint.resume=auto")
    found = find_checkpoint(Path(resume))
    if found is None:
        raise CheckpointError(f"checkpoint.resume={resume} holds no complete checkpoint (step_<N>/ with "
                              f"{COMPLETE} and {META}); a partial save is never loaded")
    return found


def resume_problem(resume: str | None, directory: Path | None, model: dict[str, Any],
                 settable: tuple[str, ...] = (), lora: dict[str, Any] | None = None,
                 steps: int | None = None) -> str | None:
    """Pre-launch check of checkpoint.resume: a one-line problem, or None (auto without a dir is checked later);
    `steps` (train.steps) refuses a checkpoint past the run's end."""
    if resume in (None, "none") or (resume == "auto" and directory is None):
        return None
    try:
        path = resolve_resume(resume, Path(directory) if directory is not None else Path("."))
        if path is None:
            return None
        read_keys(path)
        meta = read_meta(path)
        return model_mismatch(path, meta.get("model", {}), model, settable) or lora_mismatch(path, meta.get("lora"),
                                                                                              lora) \
            or (step_problem(path, meta["step"], steps) if steps is not None else None)
    except CheckpointError as error:
        return str(error)


def ownership_problem(spec: CheckpointSpec) -> str | None:
    """Pre-launch: one line when this run would save into a checkpoint.dir that another run owns, else None."""
    if spec.run_dir is None or not spec.saves:
        return None
    try:
        resumed = resolve_resume(spec.resume, spec.dir)
        return refusal(spec.dir, this_run(spec.run_dir), complete_checkpoints(spec.dir), resumed,
                       explicit=spec.resume != "auto")
    except CheckpointError as error:
        return str(error)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _fsync_write(path: Path, text: str) -> None:
    write_text(path, text, "checkpoint")  # a temporary name, flushed, renamed into place; never through a link


class CheckpointManager:
    """Saves every `every` steps and at the end, keeps the last `keep_last`, resumes at the start of a run; saves,
    prunes and cleans only in a checkpoint.dir this run owns (checkpoint.ownership)."""

    def __init__(self, spec: CheckpointSpec, state: TrainingState, data: Stateful, meta: dict[str, Any],
                 tokenizer: Any = None, on_saved: Callable[[Path], Any] | None = None):
        self.spec, self.state, self.data, self.meta, self.tokenizer = spec, state, data, meta, tokenizer
        self.on_saved = on_saved  # rank 0, given each complete checkpoint (checkpoint.export_pth's stage weights)
        self.rank0 = state.grid.rank == 0
        self.last_saved: int | None = None
        self.resumed_from: Path | None = None
        self.run: Owner | None = None  # this run as checkpoint folders record it (rank 0, when first needed)
        self.needed = 0  # the bytes of the save in flight, about (rank 0)

    def _say(self, message: str) -> None:
        """Rank 0 tells the run (console and train.log, through the `sluice` logger)."""
        if self.rank0:
            log.info(message)

    def _me(self) -> Owner:
        if self.run is None:
            self.run = this_run(self.spec.run_dir if self.spec.run_dir is not None else self.spec.dir.parent)
        return self.run

    def _world(self):
        return dist.group.WORLD if _distributed() else None

    def resume(self) -> int:
        """Load the checkpoint `resume` names (say which, or that the run starts fresh); return its step."""
        found: tuple[Path | None, str | None] = (None, None)
        if self.rank0:  # one rank looks, every rank follows (or fails with the same line)
            try:
                path = resolve_resume(self.spec.resume, self.spec.dir)
                problem = refusal(self.spec.dir, self._me(), complete_checkpoints(self.spec.dir), path,
                                  self.spec.resume != "auto") if self.spec.saves else None
                found = (path, problem)
            except CheckpointError as error:
                found = (None, str(error))
        path, error = broadcast_object(found, self._world(), src=0)
        if error:
            raise CheckpointError(error)
        if path is None:
            if self.spec.resume == "auto":
                self._say(f"no complete checkpoint in {self.spec.dir}: starting fresh")
            return 0
        meta = read_meta(path)
        problem = model_mismatch(path, meta.get("model", {}), self.meta.get("model", {}), self.spec.model_keys) \
            or lora_mismatch(path, meta.get("lora"), self.meta.get("lora"))
        if problem:
            raise CheckpointError(problem)
        start = time.perf_counter()
        load_state(path, self.state)
        self.data.load_state_dict(meta["data"])
        self.last_saved = int(meta["step"])
        self.resumed_from = path
        self._say(f"resumed from {path} (step {meta['step']}) in {time.perf_counter() - start:.2f}s")
        return int(meta["step"])

    def after_step(self, step: int) -> None:
        """Save when `step` (1-based, just completed) is a multiple of `every`."""
        if self.spec.every > 0 and step % self.spec.every == 0:
            self.save(step)

    def finish(self, step: int) -> None:
        """The final checkpoint, unless save_final=false or this step is saved already."""
        if self.spec.save_final:
            self.save(step)

    def save(self, step: int) -> Path | None:
        """Write the checkpoint of `step` (a collective); it becomes visible only once complete. A folder of another
        run, a full or read-only disk end it on every rank with the same CheckpointError; the previous checkpoint
        stays."""
        if self.last_saved == step:
            return None
        what = f"checkpoint of step {step} not written"
        check_finite(self.state, what)
        start = time.perf_counter()
        final = self.spec.dir / f"step_{step:08d}"
        tmp = self.spec.dir / f".{final.name}.tmp"
        sums = save_state(tmp, self.state, what, lambda needed: self._before_write(needed, what))
        problem = None
        if self.rank0:
            try:
                self._complete(tmp, final, step, sums, what)
                self._prune()
                if self.on_saved is not None:
                    self._say(f"wrote {self.on_saved(final)} (the next stage's checkpoint.load_dense)")
            except CheckpointError as error:
                problem = str(error)
            except OSError as error:
                problem = write_problem(error, self.spec.dir, self.needed, what) or f"{what}: {error}"
            if problem:
                shutil.rmtree(tmp, ignore_errors=True)
        if problem := broadcast_object(problem, self._world(), src=0):
            raise CheckpointError(problem)
        self.last_saved = step
        self._say(f"saved checkpoint step {step} to {final} in {time.perf_counter() - start:.2f}s")
        return final

    def _before_write(self, needed: int, what: str) -> str | None:
        """Rank 0, before any rank writes: claim the folder (or refuse another run's), remove this run's saves
        killed earlier, check the free space; one line when the save cannot go ahead."""
        directory, self.needed = self.spec.dir, needed
        try:
            problem, previous = claim(directory, self._me(), complete_checkpoints(directory), self.resumed_from,
                                      self.spec.resume != "auto")
            if problem:
                return f"{what}: {problem}"
            if previous is not None:
                log.info("checkpoint.dir %s: this run continues %s's checkpoints (it resumed from %s) and owns the "
                         "folder from now on", directory, previous.run_dir, self.resumed_from)
            for stale in directory.glob(".step_*.tmp"):  # this run's folder: a save of its own killed earlier
                if stale.is_symlink():
                    stale.unlink()  # a link where a save goes: removed, never written through (nor its target)
                else:
                    shutil.rmtree(stale, ignore_errors=True)
            return space_problem(directory, needed, what)
        except CheckpointError as error:
            return str(error)
        except OSError as error:
            return write_problem(error, directory, needed, what) or f"{what}: {directory}: {error}"

    def _complete(self, tmp: Path, final: Path, step: int, sums: dict[str, str], what: str) -> None:
        """Rank 0, after every rank wrote its share: meta.json, tokenizer, checksums, marker, then the visible
        name, if the folder is still this run's."""
        meta = {"format": 1, "step": step, "data": self.data.state_dict(), **self.meta,
                RUN_ID: self._me().run_id}  # whose checkpoint it is, in the checkpoint itself (checkpoint.ownership)
        _fsync_write(tmp / META, json.dumps(meta, indent=1))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(tmp / TOKENIZER))
            keep_written_config(self.tokenizer, tmp / TOKENIZER)  # MiniMind's config as written, not 5.x's rewrite
        _fsync_write(tmp / SUMS, sums_text({**sums, META: digest(tmp / META)}))
        if not os.path.lexists(self.spec.dir / OWNER):  # lost since the claim: rewritten (with a warning), not fatal
            claim(self.spec.dir, self._me(), complete_checkpoints(self.spec.dir), self.resumed_from,
                  self.spec.resume != "auto")
        try:
            owner = read_owner(self.spec.dir)
        except CheckpointError:
            owner = None
        if owner is None or owner.run_id != self._me().run_id:  # another run resumed from it and took it over
            where = owner.run_dir if owner is not None else "unknown"
            raise CheckpointError(f"{what}: checkpoint.dir={self.spec.dir} now belongs to another run ({where}), "
                                  "which continued this run's checkpoints; this run stops so as not to write over "
                                  "them")
        mark_complete(tmp)
        if final.exists():
            shutil.rmtree(final)  # an older save of the same step by this run (a rerun): the new one replaces it
        os.rename(tmp, final)
        fd = os.open(self.spec.dir, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)

    def _prune(self) -> None:
        prune(self.spec.dir, self.spec.keep_last)  # this run's folder (checked in _complete): its own checkpoints


def prune(directory: Path, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest `keep_last` (0 keeps all), and finish earlier prunes."""
    for leftover in directory.glob(".step_*.pruning"):
        shutil.rmtree(leftover, ignore_errors=True)  # a prune killed during its delete
    complete = complete_checkpoints(directory)
    newest = _step(complete[-1]) if complete else 0
    for folder in directory.glob("step_*"):  # visible but incomplete: half-deleted (a save becomes visible only
        if folder.is_dir() and STEP_DIR.fullmatch(folder.name) and not is_complete(folder) \
                and _step(folder) < newest:  # once complete), so never loaded and never pruned otherwise
            _remove(folder)
    if keep_last > 0:
        for old in complete[:-keep_last]:
            _remove(old)


def _step(folder: Path) -> int:
    return int(STEP_DIR.fullmatch(folder.name).group(1))


def _remove(folder: Path) -> None:
    """Hide a checkpoint folder by one rename, then delete it: a kill mid-delete leaves only a hidden folder."""
    hidden = folder.with_name(f".{folder.name}.pruning")
    os.rename(folder, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def mark_complete(folder: Path) -> None:
    """Write the completion marker (the last file of a save, before the rename)."""
    _fsync_write(folder / COMPLETE, "complete\n")
