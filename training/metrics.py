"""Rank-0 logging: a console progress bar, metrics.jsonl, TensorBoard events and optional wandb."""

import json
import logging
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

log = logging.getLogger("sluice")


class MetricsLogger:
    """Writes one record per logged step to every configured sink; a no-op on ranks other than 0."""

    def __init__(self, run_dir: Path, cfg: DictConfig, enabled: bool, start_step: int = 0):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.tensorboard = None
        self.wandb_run = None
        self.progress = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if cfg.logger.name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        elif cfg.logger.name == "wandb":
            import wandb

            self.wandb_run = wandb.init(project=cfg.logger.project, mode=cfg.logger.mode, dir=str(self.run_dir),
                                        config=OmegaConf.to_container(cfg, resolve=True))
        self.progress = tqdm(total=cfg.train.steps, initial=start_step, desc="train", dynamic_ncols=True)

    def log(self, step: int, record: dict[str, Any]) -> None:
        """Record the metrics of one optimizer step (1-based `step`)."""
        if not self.enabled:
            return
        # Strict JSON: NaN/Inf (a skipped or stopping step) are written as null.
        record = {"step": step, **{k: None if isinstance(v, float) and not math.isfinite(v) else v
                                   for k, v in record.items()}}
        self.jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self.jsonl.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                if self.tensorboard is not None:
                    self.tensorboard.add_scalar(f"train/{key}", value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=step)
        log.info("step %d loss %s lr %.3g grad_norm %s tokens/s %.0f", step, _fmt(record["loss"], ".4f"),
                 record["lr"], _fmt(record["grad_norm"], ".3f"), record["tokens_per_s"])

    def advance(self, steps: int, postfix: dict[str, Any]) -> None:
        """Move the console progress bar."""
        if self.progress is not None:
            self.progress.set_postfix(postfix, refresh=False)
            self.progress.update(steps)

    def close(self) -> None:
        """Flush and close every sink."""
        if not self.enabled:
            return
        self.progress.close()
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _fmt(value: float | None, spec: str) -> str:
    """A number for the log line; null (non-finite) as nan."""
    return "nan" if value is None else format(value, spec)
