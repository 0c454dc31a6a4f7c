"""Rank-0 metrics: one record per logged step to every sink, the progress bar, and the end-of-run summary."""

import json
import logging
import math
import os
import time
from contextlib import ExitStack
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from checkpoint.atomic_write import write_text
from training.report.console import (RunSummary, format_summary, interpreter, launcher, log_above_bar,
                                     progress_bar, run_outputs)
from training.report.flops import device_peak_tflops, flops_per_token, throughput_record
from training.config.schema import model_decoder
from training.report.loggers import open_sinks

log = logging.getLogger("sluice")


class MetricsLogger:
    """Writes one record per logged step to every configured sink; a no-op on ranks other than 0. Opening prints the run
    directory and the run's `header` lines, then starts the bar (at `start_step` when resuming: metrics.jsonl keeps only
    the rows up to it, as the steps after it are done again); closing prints the summary."""

    def __init__(self, run_dir: Path, cfg: DictConfig, enabled: bool, start_step: int = 0, device=None,
                 header: Sequence[str] = ()):
        self.enabled, self.run_dir, self.cfg = enabled, Path(run_dir), cfg
        self.records: list[dict[str, Any]] = []
        self.start_step, self.steps = start_step, 0  # this run's steps, counted as the bar moves
        if not enabled:
            return
        if dropped := drop_rows_after(self.run_dir / "metrics.jsonl", start_step):
            log.info("metrics.jsonl: %d row(s) after step %d dropped; this run does those steps again", dropped,
                     start_step)
        self.started = time.perf_counter()
        self.flops_token = flops_per_token(model_decoder(cfg), cfg.train.seq_len)
        peak = OmegaConf.select(cfg, "train.peak_tflops")  # else the device's known bf16 peak (None: CPU, unknown)
        self.peak_tflops = float(peak) if peak else device_peak_tflops(device) if device is not None else None
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        with ExitStack() as stack:  # a sink that fails to open closes the ones opened before it
            self.sinks = open_sinks(self.run_dir, cfg, stack)
            stack.enter_context(log_above_bar())
            log.info("run directory: %s", self.run_dir.resolve())
            for line in header:
                log.info(line)
            self.progress = stack.enter_context(progress_bar(cfg.train.steps, initial=start_step))
            self._stack = stack.pop_all()

    def log(self, step: int, record: dict[str, Any]) -> None:
        """Record the metrics of one optimizer step (1-based `step`), with tflops and mfu added."""
        if not self.enabled:
            return
        if "tokens_per_s" in record:  # every token computed: padding costs FLOPs too
            record = {**record, **throughput_record(record["tokens_per_s"], self.flops_token, self.world_size,
                                                    self.peak_tflops)}
        self.records.append({"step": step, **record})
        for sink in self.sinks:
            sink.write(step, record)
        log.info(step_line(step, self.cfg.train.steps, record, time.perf_counter() - self.started,
                           step - self.start_step))

    def advance(self, steps: int, postfix: dict[str, Any]) -> None:
        """Move the console progress bar."""
        self.steps += steps
        if self.enabled:
            self.progress.set_postfix(postfix, refresh=False)
            self.progress.update(steps)

    def summary(self, interrupted: str | None = None) -> RunSummary:
        """This run's steps, final losses, wall time, mean tokens/s (over logged steps after the first, which
        warms up); `interrupted` names the signal that stopped the run."""
        last = self.records[-1] if self.records else {}
        rates = [r["tokens_per_s"] for r in self.records[1:] or self.records if r.get("tokens_per_s")]
        val = [r["val_loss"] for r in self.records if r.get("val_loss") is not None]
        return RunSummary(steps=self.steps, wall_time_s=time.perf_counter() - self.started,
                          final_loss=last.get("loss"), final_val_loss=val[-1] if val else None,
                          mean_tokens_per_s=sum(rates) / len(rates) if rates else None,
                          outputs=run_outputs(self.run_dir, OmegaConf.select(self.cfg, "checkpoint.dir")),
                          start_step=self.start_step, interrupted=interrupted,
                          launcher=" ".join(launcher(dict(os.environ), interpreter())))

    def close(self, interrupted: str | None = None) -> None:
        """Close the bar, print the summary below it, then close every sink."""
        if not self.enabled:
            return
        self.progress.close()
        try:
            for line in format_summary(self.summary(interrupted), self.cfg.train.steps):
                log.info(line)
        finally:
            self._stack.close()


def drop_rows_after(path: Path, step: int) -> int:
    """Keep only the rows of metrics.jsonl up to `step` (a resumed run redoes the ones after it), rewritten
    atomically; a torn last line (a kill mid-write) goes too. Returns how many rows were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, TypeError, KeyError):
            row_step = None
        if isinstance(row_step, int) and row_step <= step:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        write_text(path, "".join(kept), "metrics")  # renamed into place: a kill leaves the old file whole
    return dropped


# What the console line leaves to metrics.jsonl: counters and bookkeeping, not a training signal.
OFF_CONSOLE = ("tokens", "step_time_s", "peak_mem_bytes", "peak_mem_rank")


def step_line(step: int, total: int, record: dict[str, Any], elapsed_s: float, done: int) -> str:
    """One logged step as a plain line a Slurm log reads well: `step 35/200`, every scalar the objective and the
    step logged (a distillation's CE and KL, DPO's rewards, GRPO's reward and KL: each objective's own terms), and the
    time this run has taken and the time it will still take at its pace so far (`done` of its steps in `elapsed_s`)."""
    terms = [f"{key} {_short(value)}" for key, value in record.items()
             if key not in OFF_CONSOLE and isinstance(value, (int, float)) and not (key == "aux_loss" and not value)]
    eta = elapsed_s / done * (total - step) if done > 0 else None
    times = [f"elapsed {_duration(elapsed_s)}"] + ([f"eta {_duration(eta)}"] if eta is not None else [])
    return " ".join([f"step {step}/{total}", *terms, *times])


def _duration(seconds: float) -> str:
    """Seconds as `45s`, `12m05s` or `3h02m`."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _short(value: Any) -> str:
    """A metric value as a short plain token for the log line: 4 significant digits, but no exponent on a large
    number (12650 tokens/s, not 1.265e+04); a small one keeps its exponent (a learning rate of 3e-05)."""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)
