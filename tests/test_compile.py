"""`train.compile=true`: compiled decoder layers train with one eager process's numbers, at the suite's fp32
tolerances, in each layout family (a ZB-H1 pipeline with its I/W split, TP, DP) and in one process. TP is the bf16
one and DP rides with EP and with an emulated pipeline: a layout of its own for each would compile the same layers
again (inductor's cold cache is the module's cost).

Inductor generates its own fused kernels, so compiled numbers differ from eager ones by fp32 round-off only; the
tolerances are the suite's (`tests.equivalence.FP32`: loss 1e-5, grad norm 1e-4, gradients 1e-5, parameters 1e-4,
relative; bf16 under TP has the bf16 TP tolerances of tests/test_equivalence.py). The layouts share one spawn of
two processes (one compile of a layer per process and shape).
"""

import pytest
import torch

from tests.equivalence import (EMU, FP32, Layout, assert_equivalent, baseline, compose_run_config, layouts_worker,
                               run_training)
from tests.shared import once_per_session
from tests.spawn import run_workers
from tests.test_equivalence import BF16_TP_TOL

pytestmark = pytest.mark.timeout(1200)  # the module's spawn compiles (inductor, cold cache) inside its first test

STEPS = ["train.steps=2", "schedule.n_microbatches=4"]  # step 2 runs the compiled graphs again, after an update
COMPILED = "train.compile=true"
TINY = ["model=tiny"]
LAYOUTS = [
    Layout("pp2-zb-h1", TINY, ["parallel.pp=2", "schedule=zb-h1", COMPILED], 2, 1),
    # Composition: EP with full recompute, an emulated ZB-V with selective recompute, bf16 under TP.
    Layout("moe-ep2-full-recompute", ["model=tiny-moe"], ["parallel.dp=2", "parallel.ep=2", "train.recompute=full",
                                                          COMPILED], 2, 2),
    Layout("dp2-pp2-zbv-emu-selective-recompute", TINY,
           ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=zbv", EMU, "train.recompute=selective",
            COMPILED], 2, 2),
    Layout("bf16-tp2", [*TINY, "train.dtype=bf16"], ["parallel.tp=2", COMPILED], 2, 1, BF16_TP_TOL),
]


def _compiled_worker(rank: int, world_size: int, runs: list, cache_dir: str) -> list[dict]:
    """The layouts, each result also counting the graphs dynamo compiled in this process so far."""
    from torch._dynamo.utils import counters

    results = layouts_worker(rank, world_size, runs, cache_dir)
    for result in results:
        result["graphs"] = counters["stats"]["unique_graphs"]
    return results


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, list[dict]]:
    def compute(root):
        runs = [([*STEPS, *case.run, *case.layout], str(root / case.name)) for case in LAYOUTS]
        by_rank = run_workers(_compiled_worker, 2, runs, str(root / "cache"), timeout=900)
        return {case.name: [r[i] for r in by_rank] for i, case in enumerate(LAYOUTS)}

    return once_per_session(tmp_path_factory, "compiled-layouts", compute)


@pytest.mark.parametrize("case", LAYOUTS, ids=[case.name for case in LAYOUTS])
def test_a_compiled_layout_equals_one_eager_process(compiled, case, tmp_path):
    results = compiled[case.name]
    assert all(r["graphs"] > 0 for r in results), "dynamo compiled nothing: the layers ran eager"
    assert_equivalent(results, baseline([*STEPS, *case.run], tmp_path / "cache", tmp_path / "eager", case.dp), case.tol)


def test_one_compiled_process_equals_eager_and_keeps_the_dense_names(tmp_path, caplog):
    """MoE: its layers share one compiled graph, and each must still count its own router's load (the logged
    expert_imbalance is compared too)."""
    import logging

    from parallel.grid import ParallelGrid

    single = ParallelGrid.single(torch.device("cpu"))
    moe = ["model=tiny-moe"]
    eager = run_training(compose_run_config([*STEPS, *moe], tmp_path / "cache"), single, tmp_path / "eager")
    cfg = compose_run_config([*STEPS, *moe, COMPILED], tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="sluice"):
        got = run_training(cfg, single, tmp_path / "compiled")
    assert got["params"].keys() == eager["params"].keys()  # compiled in place: no `_orig_mod.` in any name
    assert_equivalent([got], eager, FP32)
    assert sum("train.compile: the first step took" in r.message for r in caplog.records) == 1  # logged once
