"""A traced step on disk: the Chrome trace and the measured-vs-simulated picture, beside the run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

from .actions import Action
from .simulate import SimResult
from .timeline import chrome_trace, draw_measured_vs_simulated, measured_bubble

Trace = dict[int, list[tuple[Action, float, float]]]  # global rank -> (action, start, end), seconds


def write_trace(run_dir: str | Path, step: int, trace: Trace, simulated: SimResult) -> float:
    """Write `trace_step{N}.json` (Chrome trace, one track per rank) and `trace_step{N}.png` (measured against
    simulated) into `run_dir`; return the measured bubble fraction for metrics.jsonl."""
    path = Path(run_dir) / f"trace_step{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(trace, name=f"step {step}")))
    draw_measured_vs_simulated(simulated, trace, path.with_suffix(".png"), title=f"step {step}")
    return measured_bubble(trace)
