"""Pre-launch rules of resuming that need the run directory: a checkpoint of another global batch, and
`checkpoint.resume=auto` in a fresh directory while an earlier run of the same overrides holds checkpoints.

An earlier run is found by its overrides (Hydra's `.hydra/overrides.yaml`), not by a run directory derived from them:
Hydra's timestamped directories stay as they are, and the search covers the run directory's siblings (`runs/<name>`),
or every date's runs under Hydra's default `outputs/<date>/<time>`."""

import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig
from checkpoint.errors import CheckpointError
from checkpoint.manager import read_meta, resolve_resume, complete_checkpoints

# Overrides that may differ between a run and its continuation: where it runs, how it resumes, how long it goes.
CONTINUATION_KEYS = ("hydra.run.dir", "checkpoint.resume", "train.steps", "train.epochs")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")  # the date folder of Hydra's default hydra.run.dir (conf/config.yaml)


def global_batch(layout: dict[str, Any]) -> int:
    """Sequences per optimizer step of a layout record (checkpoint meta) or of a run: dp x micro-batches x size."""
    return int(layout["dp"]) * int(layout["n_microbatches"]) * int(layout["micro_batch_size"])


def batch_change_problem(cfg: DictConfig, checkpoints: Path, dp: int) -> str | None:
    """One line when this run (data-parallel size `dp`, its checkpoints in `checkpoints`) would resume a checkpoint
    written at another global batch, unless train.allow_batch_change=true."""
    if cfg.train.allow_batch_change:
        return None
    try:
        checkpoint = resolve_resume(cfg.checkpoint.resume, Path(checkpoints))
        saved = read_meta(checkpoint).get("layout") if checkpoint is not None else None
    except CheckpointError as error:
        return str(error)
    if not isinstance(saved, dict) or not {"dp", "n_microbatches", "micro_batch_size"} <= saved.keys():
        return None  # an older checkpoint without its layout: nothing to compare
    now = {"dp": dp, "n_microbatches": cfg.schedule.n_microbatches, "micro_batch_size": cfg.train.micro_batch_size}
    before, after = global_batch(saved), global_batch(now)
    if before == after:
        return None
    shape = "dp {dp} x schedule.n_microbatches {n_microbatches} x train.micro_batch_size {micro_batch_size}"
    return (f"checkpoint {checkpoint} was written at a global batch of {before} ({shape.format(**saved)}) and this "
            f"run has {after} ({shape.format(**now)}); launch it as before (the same world size and batch keys), or "
            "set train.allow_batch_change=true to continue at the new batch")


def _overrides(run_dir: Path) -> list[str] | None:
    """A run directory's overrides as Hydra recorded them, less the keys a continuation changes; None if unreadable."""
    try:
        recorded = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(recorded, list):
        return None
    return sorted(str(o) for o in recorded if str(o).lstrip("+~").partition("=")[0] not in CONTINUATION_KEYS)


def earlier_run(run_dir: Path) -> tuple[Path, Path] | None:
    """(run directory, newest checkpoint) of the most recent other run whose overrides equal this one's (apart from
    CONTINUATION_KEYS), among the run directory's siblings and cousins; None when there is none."""
    run_dir = Path(run_dir).resolve()
    mine = _overrides(run_dir)
    if mine is None:
        return None
    # Hydra's default outputs/<date>/<time>: every date's runs; else the run directory's siblings (runs/<name>).
    root, pattern = ((run_dir.parent.parent, "*/*/.hydra/overrides.yaml") if DATE.fullmatch(run_dir.parent.name)
                     else (run_dir.parent, "*/.hydra/overrides.yaml"))
    candidates = {p.parent.parent.resolve() for p in root.glob(pattern)}
    found = []
    for other in candidates - {run_dir}:
        checkpoints = complete_checkpoints(other / "checkpoints")
        if checkpoints and _overrides(other) == mine:
            found.append((checkpoints[-1].stat().st_mtime, other, checkpoints[-1]))
    return max(found)[1:] if found else None


def fresh_resume_problem(run_dir: Path, checkpoints: Path) -> str | None:
    """One line when `checkpoint.resume=auto` finds nothing in this run's `checkpoints` while an earlier run of the
    same overrides holds some: a new directory would otherwise start over in silence."""
    if complete_checkpoints(checkpoints) or (found := earlier_run(run_dir)) is None:
        return None
    other, newest = found
    return (f"checkpoint.resume=auto: {run_dir} holds no checkpoint, but {other} holds {newest.name} of a run with the "
            f"same overrides; continue that run with hydra.run.dir={other} checkpoint.resume=auto (or "
            f"checkpoint.resume={newest}), or start over with checkpoint.resume=none")
