"""What rank 0 shows on the terminal: the run directory, one progress bar, log lines above it, a summary."""

import logging
import os
import shlex
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml
from tqdm import tqdm

from checkpoint.manager import complete_checkpoints
from training.config.resume_rules import fresh_resume_problem
from checkpoint.errors import CheckpointError
from checkpoint.ownership import read_owner, this_run, written_by

log = logging.getLogger("sluice")
TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"


def run_dir_problem(run_dir: Path, resume: str | None, checkpoints: Path | None = None) -> str | None:
    """One line when a run would mix its metrics into an earlier run's: a fresh run into a used directory, or
    `checkpoint.resume=auto` where `checkpoints` (default `<run dir>/checkpoints`) holds nothing to resume from."""
    metrics = Path(run_dir) / "metrics.jsonl"
    checkpoints = Path(checkpoints) if checkpoints is not None else Path(run_dir) / "checkpoints"
    if not metrics.exists():  # gone, but the checkpoints still say whose they are
        if resume == "auto":  # a fresh directory: did an earlier run of the same overrides save elsewhere?
            return fresh_resume_problem(run_dir, checkpoints)
        return earlier_checkpoints(run_dir, checkpoints) if resume in (None, "", "none") else None
    if resume == "auto":
        if complete_checkpoints(checkpoints):
            return None
        return (f"checkpoint.resume=auto: run directory {run_dir} holds {metrics.name} but {checkpoints} holds no "
                "complete checkpoint to resume from; start a fresh run (a new hydra.run.dir, or drop it), or resume "
                "from an explicit checkpoint with checkpoint.resume=<checkpoint folder>")
    if resume not in (None, "", "none"):
        return None
    return (f"run directory {run_dir} already holds {metrics.name} from an earlier run; choose a new "
            "hydra.run.dir (or drop it for a fresh timestamped one), delete the old run, "
            "or continue it with checkpoint.resume")


def earlier_checkpoints(run_dir: Path, checkpoints: Path) -> str | None:
    """One line when a fresh run (no resume) would save into a folder holding this run directory's earlier
    checkpoints, with or without its metrics.jsonl: the run id persists in the run directory, so its saves would
    replace them. Another run's folder is checkpoint.ownership's to refuse, in its own words."""
    found = complete_checkpoints(checkpoints)
    if not found:
        return None
    try:
        owner, me = read_owner(checkpoints), this_run(run_dir)
    except CheckpointError as error:
        return str(error)
    if (owner is not None and owner.run_id != me.run_id) or written_by(found[-1]) not in (None, me.run_id):
        return None  # another run's: ownership_problem refuses it
    return (f"checkpoint.dir={checkpoints} already holds checkpoints of an earlier run in {run_dir} (newest "
            f"{found[-1].name}), which a fresh run would overwrite; continue them with checkpoint.resume=auto, or "
            "choose a new hydra.run.dir (or drop it for a fresh timestamped one)")


def interpreter() -> str:
    """The Python this run was started with, as the user would type it (relative when under the working directory)."""
    executable = Path(sys.executable)
    return os.path.relpath(executable) if executable.is_relative_to(Path.cwd()) else str(executable)


def resume_command(run_dir: Path, env: dict[str, str], argv: list[str]) -> str:
    """The command that continues an interrupted run in the same run directory from its newest checkpoint: this
    interpreter, train.py, the run's own overrides (Hydra's record, else `argv`), then hydra.run.dir and
    checkpoint.resume=auto."""
    record = Path(run_dir) / ".hydra" / "overrides.yaml"
    try:
        overrides = [str(o) for o in yaml.safe_load(record.read_text())] if record.is_file() else list(argv[1:])
    except (OSError, ValueError, TypeError, yaml.YAMLError):
        overrides = list(argv[1:])
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+") not in ("checkpoint.resume", "hydra.run.dir")]
    script = os.path.relpath(TRAIN_PY) if TRAIN_PY.is_relative_to(Path.cwd()) else str(TRAIN_PY)
    words = [*launcher(env, sys.executable), script, *kept, f"hydra.run.dir={run_dir}", "checkpoint.resume=auto"]
    return " ".join(word if word.startswith("<") else shlex.quote(word) for word in words)


def launcher(env: dict[str, str], python: str) -> list[str]:
    """The launcher of this run as the user types it again, with the world it gave: `torchrun --nproc-per-node N`
    (and its nodes) where torchrun started this rank, else `python` (train.py launches the layout's workers itself).
    A different world would change the global batch of a run whose parallel.dp follows the world size."""
    if "TORCHELASTIC_RUN_ID" not in env or env.get("SLUICE_SELF_LAUNCHED") == "1":
        return [python]
    nodes, per_node = env.get("GROUP_WORLD_SIZE", "1"), env.get("LOCAL_WORLD_SIZE", "<same>")
    rendezvous = [] if nodes == "1" else ["--nnodes", nodes, "<same rendezvous options>"]
    return ["torchrun", *rendezvous, "--nproc-per-node", per_node]


class TqdmHandler(logging.Handler):
    """A console handler that writes through tqdm.write, so a log line never lands on the bar's line."""

    def __init__(self, stream, formatter: logging.Formatter | None):
        super().__init__()
        self.stream = stream
        self.setFormatter(formatter or logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # logging must never take the run down
            self.handleError(record)


@contextmanager
def log_above_bar() -> Iterator[None]:
    """Route the root logger's console output through tqdm.write while a bar is shown; restore it after. Where nothing
    prints log lines to the console (self-launched workers log to train.log only), add one, so every launch path shows
    the same lines. tqdm.contrib.logging does the swap but never adds a handler."""
    root = logging.getLogger()
    consoles = [h for h in root.handlers
                if type(h) is logging.StreamHandler and getattr(h, "stream", None) in (sys.stdout, sys.stderr)]
    replacements = [TqdmHandler(h.stream, h.formatter) for h in consoles] or [TqdmHandler(sys.stdout, None)]
    for handler in consoles:
        root.removeHandler(handler)
    for handler in replacements:
        root.addHandler(handler)
    level = root.level
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        for handler in replacements:
            root.removeHandler(handler)
        for handler in consoles:
            root.addHandler(handler)
        root.setLevel(level)


def progress_bar(total: int, initial: int = 0) -> tqdm:
    """The one training bar (rank 0 only); on stderr, while log lines go to stdout above it. Only on a terminal:
    redirected output (Slurm, `> file`) gets the plain line of each logged step and no carriage returns."""
    return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, file=sys.stderr,
                disable=not sys.stderr.isatty())


@dataclass
class RunSummary:
    """What the end-of-run summary reports."""

    steps: int
    wall_time_s: float
    final_loss: float | None
    final_val_loss: float | None
    mean_tokens_per_s: float | None
    outputs: dict[str, str]  # label -> where, only the outputs that exist
    start_step: int = 0  # the step this run resumed from: `steps` counts this run's own
    interrupted: str | None = None  # the signal that stopped the run (SIGINT, SIGTERM)
    launcher: str | None = None  # how the run was launched (`torchrun --nproc-per-node 2`); None: this interpreter

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps


def format_summary(summary: RunSummary, total_steps: int) -> list[str]:
    """The summary as a few lines: figures first, then where everything was written."""
    resumed = f" from step {summary.start_step}" if summary.start_step else ""
    figures = [f"{summary.steps} steps{resumed} in {summary.wall_time_s:.1f} s"]
    if summary.final_loss is not None:
        figures.append(f"final loss {summary.final_loss:.4f}")
    if summary.final_val_loss is not None:
        figures.append(f"val loss {summary.final_val_loss:.4f}")
    if summary.mean_tokens_per_s is not None:
        figures.append(f"mean {summary.mean_tokens_per_s:.0f} tokens/s")
    if summary.interrupted:
        ended = f"interrupted by {summary.interrupted} at step {summary.last_step} (of {total_steps} steps)"
    else:
        ended = "done" if summary.last_step >= total_steps else f"stopped early (of {total_steps} steps)"
    lines = [f"{ended}: " + ", ".join(figures)]
    lines += [f"  {label}: {path}" for label, path in summary.outputs.items()]
    if "checkpoints" in summary.outputs:  # what a user does next, with the paths filled in
        checkpoints, python = summary.outputs["checkpoints"], interpreter()
        continued = [] if summary.interrupted else [  # an interrupted run's line after this gives its command
            f"  continue: {summary.launcher or python} train.py <same overrides> train.steps=<new total> "
            f"checkpoint.resume={checkpoints}"]
        lines += ["next:", *continued,
                  f"  export:   {python} scripts/export_hf.py {checkpoints} <out folder>",
                  f"  generate: {python} scripts/generate.py <out folder> \"<prompt>\""]
    return lines


def run_outputs(run_dir: Path, checkpoint_dir: str | None) -> dict[str, str]:
    """The run's outputs that exist on disk, by label."""
    candidates = {
        "metrics": run_dir / "metrics.jsonl",
        "log": run_dir / "train.log",
        "tensorboard": run_dir / "tb",
        "wandb": run_dir / "wandb",
        "checkpoints": Path(checkpoint_dir) if checkpoint_dir else run_dir / "checkpoints",
    }
    found = {label: str(path) for label, path in candidates.items() if path.exists()}
    traces = sorted(run_dir.glob("trace_step*.json"))
    if traces:
        found["traces"] = ", ".join(str(path) for path in traces)
    return found


def quiet_progress_bars(rank: int) -> None:
    """Only global rank 0 draws bars: silence the libraries' own (datasets' "tokenizing") on every other rank."""
    if rank != 0:
        import transformers

        if "datasets" in sys.modules:
            sys.modules["datasets"].disable_progress_bars()
        else:  # datasets reads this when first imported: a run that never tokenizes skips its 0.5 s import
            os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        transformers.utils.logging.disable_progress_bar()
