"""Metric sinks of global rank 0: metrics.jsonl (always), TensorBoard and wandb (any subset, `logger.backends`)."""

import json
import math
import netrc
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from checkpoint.atomic_write import open_append

WANDB_MODES = ("offline", "online", "disabled")


def logger_backends(cfg: DictConfig) -> list[str]:
    """The configured sinks besides metrics.jsonl, without duplicates and without `none`."""
    return [name for name in dict.fromkeys(cfg.logger.backends) if name != "none"]


def wandb_has_credentials() -> bool:
    """True when wandb online could authenticate: WANDB_API_KEY or a netrc entry for the wandb host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def logger_problem(cfg: DictConfig) -> str | None:
    """One line naming what is wrong with the logger settings and the fix; None when they are usable."""
    names = list(cfg.logger.backends)
    for name in names:
        if name not in (*SINKS, "none"):
            return f"logger.backends: unknown logger {name!r}; use any of tensorboard, wandb (or none)"
    if "none" in names and len(set(names)) > 1:
        return f"logger.backends={names} mixes none with loggers; drop none"
    if "wandb" not in names:
        return None
    mode = OmegaConf.select(cfg, "logger.mode")
    if mode not in WANDB_MODES:
        return f"logger.mode={mode} is not a wandb mode; use one of {', '.join(WANDB_MODES)}"
    if not OmegaConf.select(cfg, "logger.project"):
        return "logger.project is empty; name the wandb project (logger.project=sluice)"
    if mode == "online" and not wandb_has_credentials():
        return ("logger.mode=online needs wandb credentials: run `wandb login` or set WANDB_API_KEY, "
                "or use logger.mode=offline and `wandb sync` the run's wandb/ folder later")
    return None


def flat_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as dotted keys with scalar values (lists as text): TensorBoard's hparams need it."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            key = prefix[:-1]
            flat[key] = node if isinstance(node, (bool, int, float, str)) else str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


class JsonlSink:
    """metrics.jsonl: one strict-JSON object per logged step, flushed at once."""

    def __init__(self, run_dir: Path):
        self.file = open_append(run_dir / "metrics.jsonl", "metrics")  # never through a link

    def write(self, step: int, record: dict[str, Any]) -> None:
        # NaN and infinities become null, so every reader's strict parser accepts the file.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps({"step": step, **clean}, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """tb/: scalars under train/, the composed config as text and as hparams in the same event file."""

    def __init__(self, run_dir: Path, cfg: DictConfig):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        yaml = OmegaConf.to_yaml(cfg, resolve=True)
        self.writer.add_text("config", "```yaml\n" + yaml + "```", 0)  # markdown: keep the indentation
        # add_hparams would open a second event file in a sub-folder; these summaries join this one.
        for summary in hparams(flat_config(cfg), {"train/loss": 0.0}):
            self.writer.file_writer.add_summary(summary)

    def write(self, step: int, record: dict[str, Any]) -> None:
        for key, value in record.items():
            for name, scalar in (value.items() if isinstance(value, dict) else [(None, value)]):
                if isinstance(scalar, (int, float)) and not isinstance(scalar, bool):  # a dict: one chart per entry
                    self.writer.add_scalar(f"train/{key}" + (f"/{name}" if name else ""), scalar, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run in the run directory (offline by default) with the composed config as its config."""

    def __init__(self, run_dir: Path, cfg: DictConfig):
        import wandb

        self.run = wandb.init(project=cfg.logger.project, mode=cfg.logger.mode, dir=str(run_dir),
                              config=OmegaConf.to_container(cfg, resolve=True))

    def write(self, step: int, record: dict[str, Any]) -> None:
        self.run.log(record, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # finish() can return before the service wrote the run file; teardown waits for it


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink}  # logger.backends name -> sink class


def open_sinks(run_dir: Path, cfg: DictConfig, stack: ExitStack) -> list:
    """Open metrics.jsonl and every configured backend; each is registered on stack as soon as it is open,
    so a backend that fails to start leaves nothing open once the caller's stack unwinds."""
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks = []
    for make in [lambda: JsonlSink(run_dir)] + [lambda name=name: SINKS[name](run_dir, cfg)
                                                for name in logger_backends(cfg)]:
        sink = make()
        stack.callback(sink.close)
        sinks.append(sink)
    return sinks
