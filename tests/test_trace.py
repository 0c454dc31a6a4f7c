"""Tracing a step: every rank times its actions, rank 0 writes one Chrome trace and a measured-vs-simulated PNG."""

import dataclasses
import json
from pathlib import Path

import torch

from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from parallel.pipeline.trace_files import write_trace
from tests.equivalence import layout_worker
from tests.spawn import run_workers
from tests.test_runtime import batches, layout_cfg, tiny


def trace_worker(rank: int, world_size: int, schedule: str, run_dir: str) -> float | None:
    """One traced step of a pp=world_size layout; rank 0 writes the files and returns the measured bubble."""
    grid = ParallelGrid.build(None, 1, world_size, backend="gloo", timeout_s=60)
    cfg = layout_cfg(schedule, world_size, 4)
    cfg = dataclasses.replace(cfg, emulate=False)
    engine = ParallelEngine(cfg, tiny(), grid)
    result = engine.step(batches(4), trace=True)
    if grid.rank != 0:
        assert result.trace is None
        return None
    return write_trace(run_dir, 3, result.trace, engine.simulated_step)


def check_trace(path: Path, ranks: int, kinds: set[str]) -> None:
    """Valid JSON, one named track per rank, and complete events of `kinds` on every track."""
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == {r: f"rank {r}" for r in range(ranks)}
    for r in range(ranks):
        names = [e["name"] for e in events if e["ph"] == "X" and e["tid"] == r]
        assert {n[0] for n in names if n[0] in "FBIW"} == kinds, names
        assert any(n.startswith(("SEND", "RECV")) for n in names)
        assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_traced_pp2_step_writes_chrome_trace_and_timeline(tmp_path):
    bubbles = run_workers(trace_worker, 2, "1f1b", str(tmp_path), timeout=120)
    check_trace(tmp_path / "trace_step3.json", 2, {"F", "B"})
    png = tmp_path / "trace_step3.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 0.0 <= bubbles[0] < 1.0 and bubbles[1] is None


def test_emulated_trace_has_every_pipeline_rank(tmp_path):
    engine = ParallelEngine(layout_cfg("zb-h1", 2, 4), tiny(), ParallelGrid.single(torch.device("cpu")))
    trace = engine.step(batches(4), trace=True).trace
    bubble = write_trace(tmp_path, 1, trace, engine.simulated_step)
    check_trace(tmp_path / "trace_step1.json", 2, {"F", "I", "W"})
    assert 0.0 <= bubble < 1.0


def test_trainer_traces_the_configured_step(tmp_path):
    overrides = ["model=tiny", "parallel.pp=2", "train.steps=2", "train.trace_step=2", "train.log_every=5"]
    run_workers(layout_worker, 2, overrides, str(tmp_path / "cache"), str(tmp_path / "run"), timeout=120)
    check_trace(tmp_path / "run" / "trace_step2.json", 2, {"F", "B"})
    assert (tmp_path / "run" / "trace_step2.png").exists()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    traced = [r for r in records if "bubble_fraction" in r]
    assert [r["step"] for r in traced] == [2] and 0.0 <= traced[0]["bubble_fraction"] < 1.0
