"""The benchmark scripts run end to end (tiny smoke sizes) and write results.json and the page in their shape.

Timings are not checked (benchmarks are scripts, not tests); the numbers that must hold whatever the load are:
equal losses for Sluice and torch.distributed.pipelining, and activation bytes that the meter counts exactly.
"""

import importlib
import json
import statistics
import sys
from unittest import mock

import pytest
import torch

from tests.conftest import ROOT
from tests.spawn import run_workers

BENCH = ROOT / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

from common import ActivationMeter  # noqa: E402

SLEEP = ("1f1b", "zbv")  # the smoke runs a loop schedule and a V one (make bench runs all five)
REAL = ("1f1b", "interleaved-1f1b")


def bench_job(rank: int, world_size: int, module: str, name: str, *args):
    """A benchmark's worker function run in a pooled test worker (which may predate scripts/bench on sys.path).

    On the pooled worker's one intra-op thread: the one-process benchmarks ask for the machine's cores, and two
    threads beside the other test worker's processes spun 30x slower (an eager step of the tiny model 1.2 s, not
    0.04 s); the smoke checks paths, not figures, and the pooled worker keeps its one thread for later tests."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    with mock.patch.object(torch, "set_num_threads", lambda threads: None):
        return getattr(importlib.import_module(module), name)(rank, world_size, *args)


def in_this_process(monkeypatch):
    """run_all's benchmarks as calls of their `main` here, their workers the session's pooled ones (the same
    env:// wiring as their own spawn): twenty-one interpreter start-ups fewer than `make bench ARGS=--smoke`."""
    import run_all

    def pooled(fn, world, *args, timeout):
        return run_workers(bench_job, world, fn.__module__, fn.__name__, *args, timeout=timeout)

    def run_benchmark(script: str, argv: list[str]) -> None:
        module = importlib.import_module(script.removesuffix(".py"))
        if hasattr(module, "run_workers"):  # sizes.py spawns through data_parallel's and compiled's, patched before it
            monkeypatch.setattr(module, "run_workers", pooled)
        module.main(argv)

    monkeypatch.setattr(run_all, "run_benchmark", run_benchmark)
    return run_all


def compile_rows_uncompiled(cells, layouts, warmup, rounds, mode, cache=None):
    """compiled.measure_cells's rows without compiling (compiled.py's own smoke compiles): the sweep's glue is tested."""
    return [{"cell": cell.name, "layout": layout, "mode": mode, "choice": "eager", "ratio": 1.0, "spread": 0.0,
             "eager_s": 1.0, "compiled_s": 1.0} for cell in cells for layout in layouts]


def test_the_size_sweeps_launches_pool_their_rounds():
    """`sizes.py --launches K`: one median and spread over every launch's rounds, each launch's own ratio beside it,
    step-time medians over the launches', every run kept, and auto's choice as most launches made it."""
    sizes = importlib.import_module("sizes")
    launch = lambda ratios, choice, sluice: {"h1": {"compile": {
        "ratio": statistics.median(ratios), "spread": 0.0, "round_ratios": ratios, "choice": choice,
        "sluice_s": sluice, "sluice_min_s": sluice - 0.1, "sluice_runs_s": [sluice] * len(ratios)}}}
    row = sizes.pooled([launch([1.0, 1.1, 1.2], "eager", 2.0), launch([0.8, 0.9], "compiled", 1.0),
                        launch([0.95], "eager", 3.0)])["h1"]["compile"]
    assert row["round_ratios"] == [1.0, 1.1, 1.2, 0.8, 0.9, 0.95] and row["ratio"] == pytest.approx(0.975)
    q1, _, q3 = statistics.quantiles(row["round_ratios"], n=4, method="inclusive")
    assert row["spread"] == pytest.approx((q3 - q1) / 2) and row["launch_ratios"] == pytest.approx([1.1, 0.85, 0.95])
    assert row["sluice_s"] == 2.0 and row["sluice_min_s"] == pytest.approx(0.9) and len(row["sluice_runs_s"]) == 6
    assert row["choice"] == "eager" and row["choices"] == ["eager", "compiled", "eager"]


@pytest.mark.timeout(900)
def test_make_bench_smoke_writes_results_page_and_timelines(tmp_path, monkeypatch):
    results, doc, pngs = tmp_path / "results.json", tmp_path / "benchmarks.md", tmp_path / "png"
    heat_map = tmp_path / "sizes.png"
    monkeypatch.setattr(importlib.import_module("compiled"), "measure_cells", compile_rows_uncompiled, raising=False)
    in_this_process(monkeypatch).main(["--smoke", "--results", str(results), "--doc", str(doc), "--png-dir", str(pngs),
                                       "--heat-map", str(heat_map)])
    r = json.loads(results.read_text())
    for name in SLEEP:
        assert isinstance(r["sleep"][name]["sluice_over_ideal"], float) and r["sleep"][name]["sluice_over_ideal"] > 0
        assert r["sleep"][name]["torch_over_ideal"] is None or r["sleep"][name]["torch_over_ideal"] > 0
        row = r["sleep"][name]["by_m"]["4"]  # the paired rounds: one Sluice and one torch step each
        assert row["rounds"] == len(row["sluice_runs_s"]) == len(row["torch_runs_s"]) >= 1
        assert 0 <= row["sluice_wins"] <= row["rounds"] and isinstance(row["paired_diff_ms"], float)
        assert row["sluice_transport"] == "ShmTransport" and row["sluice_gloo_over_ideal"] > 0  # and over gloo
    assert sorted(p.name for p in pngs.iterdir()) == sorted(f"sleep_{n}_pp4_m4.png" for n in SLEEP)
    for name in REAL:
        assert isinstance(r["real"][name]["sluice_over_torch"], float)
        assert 0 <= r["real"][name]["sluice_wins"] <= r["real"][name]["rounds"] == len(r["real"][name]["sluice_runs_s"])
        assert r["real"][name]["losses_equal"] is True, (r["real"][name]["sluice_loss"], r["real"][name]["torch_loss"])
        assert r["real"][name]["sluice_shm_over_torch"] > 0
    for name in REAL:  # the default-size pipeline (make bench runs pp4 too, the same code)
        row = r["full_size"][f"pp2 {name}"]
        assert row["losses_equal"] is True and row["sluice_s"] > 0, row
        assert len(row["sluice_peak_bytes"]) == len(row["torch_peak_bytes"]) == 2
    peaks = r["memory"]["1f1b"]
    assert len(peaks["sluice_peak_bytes"]) == len(peaks["torch_peak_bytes"]) == 4
    assert all(b > 0 for b in peaks["sluice_peak_bytes"] + peaks["torch_peak_bytes"])
    assert r["overhead"]["ratio"] > 0
    assert r["transport"]["gloo_hop_us"] > 0 and r["transport"]["shm_hop_us"] > 0
    assert r["overhead"]["first_loss"]["sluice"] == pytest.approx(r["overhead"]["first_loss"]["plain"], rel=1e-6)
    rollout = r["rollout"]  # greedy decoding: the script refuses figures unless both sides made the same tokens
    assert rollout["sluice_tokens_per_s"] > 0 and rollout["transformers_tokens_per_s"] > 0, rollout
    for name in ("pp2", "tp2"):  # the same greedy tokens as one process, and an idle share per rank
        row = rollout["layouts"][name]
        assert row["tokens_equal"] is True and len(row["bubble_by_rank"]) == 2 and row["speed_ratio"] > 0, row
    experts = r["experts"]  # exact whatever the load: counted bytes, and the same first loss at ep=1 and ep=4
    assert experts["losses_equal"] is True, experts["first_loss"]
    assert experts["memory_met"] is True and experts["memory_fall"] > 0, experts  # met: compared in whole bytes
    assert experts["ep4_s"] > 0 and experts["ep1_s"] > 0
    for name, row in r["data_parallel"]["rows"].items():  # the same model, data and optimizer on both sides
        assert row["losses_equal"] is True and row["sluice_s"] > 0 and row["peak_mib"]["torch"] > 0, (name, row)
    for dp, table in r["fsdp"]["memory"].items():  # counted bytes, exact whatever the load: zero=3 holds 1/dp
        rows = table["rows"]
        assert rows["zero3"]["total"] < rows["zero1"]["total"] < rows["dp"]["total"] and table["goal_met"], (dp, rows)
    for step in r["fsdp"]["steps"].values():  # zero=3, zero=2 and the fully_shard loop: the same model and data
        assert step["losses_equal"] is True and step["sluice_s"] > 0 and step["torch_s"] > 0, step
        assert rows["zero3"]["in_step"] < rows["zero2"]["in_step"]  # zero=3 frees the weights after each backward
    tp = r["tensor_parallel"]  # Sluice's TP layers and DTensor's on the same plan: the same losses, step after step
    assert tp["losses_equal"] is True and tp["last_losses_close"] is True, (tp["first_loss"], tp["last_loss"])
    assert tp["sluice_s"] > 0 and tp["torch_s"] > 0 and len(tp["peak_mib_by_rank"]["torch"]) == 2
    assert r["recompute"]["losses_equal"] is True, r["recompute"]["rows"]
    assert all(row["peak_mib"] > 0 and row["step_s"] > 0 for row in r["recompute"]["rows"].values())
    compiled = r["compiled"]["rows"][0]  # a compiled layer trains with eager's first loss
    assert compiled["losses_close"] is True and compiled["compiled_s"] > 0 and compiled["eager_s"] > 0, compiled
    sizes = r["sizes"]  # the sweep's one tiny cell, one round: every comparison measured, the heat map drawn
    (cell,) = sizes["cells"]
    assert set(sizes["ratios"][cell]) == {"compile", "compile_pp2", "dp", "zero1"}, sizes["ratios"]
    for name in ("dp", "zero1"):  # both sides trained the same model on the same data
        row = sizes["ratios"][cell][name]
        assert row["ratio"] > 0 and row["spread"] == 0 and len(row["round_ratios"]) == 1, row
        assert row["first_loss"]["sluice"] == pytest.approx(row["first_loss"]["torch"], rel=1e-5), row
    assert sizes["worst"]["cell"] == cell and heat_map.read_bytes().startswith(b"\x89PNG")
    page = doc.read_text()
    assert "## Model sizes: Sluice / peer across a grid of sizes" in page and "![size sweep](sizes.png)" in page
    assert "## Acceptance" in page and "make bench ARGS=--smoke" in page and "## Transport" in page
    assert "## Expert parallelism: ep=4 against replicated experts (dp=4)" in page
    assert "## Compiled layers: `train.compile=true` against eager" in page
    assert "## Data parallelism against DistributedDataParallel (dp=2)" in page
    assert "## Sharded data parallelism: `parallel.zero` 0 to 3" in page
    assert "## Tensor parallelism against DTensor `parallelize_module` (tp=2)" in page
    assert "## Recomputation against `torch.utils.checkpoint`" in page
    assert "## Rollouts: decoding against transformers' `generate`" in page
    assert all(f"| {name} |" in page for name in SLEEP)


def test_activation_meter_counts_saved_storages_once_until_backward_frees_them():
    meter = ActivationMeter()
    x = torch.ones(256, requires_grad=True)  # 1 KiB
    with meter.saved_tensors():
        y = x.exp()  # saves its output (1 KiB)
        z = (y * y).sum()  # saves y twice: the same storage, counted once
    assert meter.peak == meter.live == 1024
    z.backward()
    del z, y
    assert meter.live == 0 and meter.peak == 1024
