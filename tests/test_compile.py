"""`train.compile=true` and `auto` (which toggles the layers between compiled and eager, then keeps the faster):
compiled decoder layers train with one eager process's numbers, at the suite's fp32 tolerances, in each layout
family (a ZB-H1 pipeline with its I/W split, TP, DP) and in one process. TP is the bf16
one and DP rides with EP and with an emulated pipeline: a layout of its own for each would compile the same layers
again (inductor's cold cache is the module's cost).

Inductor generates its own fused kernels, so compiled numbers differ from eager ones by fp32 round-off only; the
tolerances are the suite's (`tests.equivalence.FP32`: loss 1e-5, grad norm 1e-4, gradients 1e-5, parameters 1e-4,
relative; bf16 under TP has tolerances derived from bf16, `tests.equivalence.bf16_tolerances`). The layouts share one
spawn of two processes (one compile of a layer per process and shape).
"""

import pytest
import torch

from tests.equivalence import (EMU, FP32, Layout, assert_equivalent, assert_equivalent_bf16, baseline,
                               compose_run_config, layouts_worker, run_training)
from tests.shared import once_per_session
from tests.spawn import run_workers

pytestmark = pytest.mark.timeout(1200)  # the module's spawn compiles (inductor, cold cache) inside its first test

STEPS = ["train.steps=2", "schedule.n_microbatches=4"]  # step 2 runs the compiled graphs again, after an update
COMPILED = "train.compile=true"
AUTO = "train.compile=auto"
TINY = ["model=tiny"]
LAYOUTS = [
    Layout("pp2-zb-h1", TINY, ["parallel.pp=2", "schedule=zb-h1", COMPILED], 2, 1),
    # Composition: EP with full recompute, an emulated ZB-V with selective recompute, bf16 under TP, FSDP.
    Layout("moe-ep2-full-recompute", ["model=tiny-moe"], ["parallel.dp=2", "parallel.ep=2", "train.recompute=full",
                                                          COMPILED], 2, 2),
    Layout("dp2-pp2-zbv-emu-selective-recompute", TINY,
           ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=zbv", EMU, "train.recompute=selective",
            COMPILED], 2, 2),
    Layout("bf16-tp2", [*TINY, "train.dtype=bf16"], ["parallel.tp=2", COMPILED], 2, 1),
    Layout("dp2-zero3", TINY, ["parallel.dp=2", "parallel.zero=3", COMPILED], 2, 2),  # FSDP's hooks around each layer
    # train.compile=auto: compiled, then eager and compiled in turns (its trial), then the faster; 11 steps pass the
    # choice (the same layers and shapes as pp2-zb-h1: dynamo's cache, no compile of their own).
    Layout("pp2-1f1b-auto", [*TINY, "train.steps=11"], ["parallel.pp=2", "schedule=1f1b", AUTO], 2, 1),
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
    reference = baseline([*STEPS, *case.run], tmp_path / "cache", tmp_path / "eager", case.dp)
    if "train.dtype=bf16" in case.run:
        fp32 = baseline([*STEPS, *case.run, "train.dtype=fp32"], tmp_path / "cache", tmp_path / "fp32", case.dp)
        assert_equivalent_bf16(results, reference, fp32)
    else:
        assert_equivalent(results, reference, case.tol)


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


def test_auto_chooses_by_the_measured_steps_logs_it_once_and_trains_as_eager(tmp_path, caplog):
    """train.compile=auto in one process (the MoE model and shapes of the test above: dynamo's cache)."""
    import logging
    import re

    from parallel.grid import ParallelGrid

    single = ParallelGrid.single(torch.device("cpu"))
    run = [*STEPS, "model=tiny-moe", "train.steps=11"]
    eager = run_training(compose_run_config(run, tmp_path / "cache"), single, tmp_path / "eager")
    with caplog.at_level(logging.INFO, logger="sluice"):
        got = run_training(compose_run_config([*run, AUTO], tmp_path / "cache"), single, tmp_path / "auto")
    assert_equivalent([got], eager, FP32)
    lines = [r.message for r in caplog.records if r.message.startswith("train.compile=auto")]
    assert len(lines) == 1, lines
    found = re.fullmatch(r"train.compile=auto: compiled steps took (\S+) s, eager steps (\S+) s \(median of 4 each\): "
                         r"(keeping the compiled layers|running eager from now on)", lines[0])
    assert found, lines[0]
    compiled_s, eager_s = float(found[1]), float(found[2])
    assert found[3] == ("keeping the compiled layers" if compiled_s < eager_s else "running eager from now on")


class _Chunk:
    """A stand-in for a Decoder: only its layers."""

    def __init__(self, layers):
        self.layers = layers

    def blocks(self):
        return list(enumerate(self.layers))


def _compiled_layers(n: int) -> list[torch.nn.Module]:
    layers = [torch.nn.Linear(2, 2) for _ in range(n)]
    for layer in layers:
        layer.compile()  # nothing is compiled before a call
    return layers


def test_auto_warms_eager_up_times_compiled_and_eager_in_abba_order_then_keeps_the_faster_median():
    from parallel.compile import CompileTrial

    layers = _compiled_layers(2)
    trial = CompileTrial([_Chunk(layers)], torch.device("cpu"), None)
    modes, choice = [], None
    # The compiling step, the untimed eager warm-up (however slow), then C E E C C E E C: medians 1.75 and 3.0 s.
    for seconds in (9.0, 100.0, 1.0, 2.0, 4.0, 3.0, 1.5, 3.5, 2.5, 2.0):
        choice = trial.after_step(seconds)
        modes.append(all(layer._compiled_call_impl is not None for layer in layers))
    assert modes == [False, True, False, False, True, True, False, False, True, True]
    assert (choice.compiled_s, choice.eager_s, choice.compiled) == (1.75, 3.0, True)
    assert trial.after_step(0.1) is None  # chosen once

    slow = CompileTrial([_Chunk(layers)], torch.device("cpu"), None)
    for seconds in (9.0, 0.1, 5.0, 2.0, 2.0, 5.0, 5.0, 2.0, 2.0, 5.0):
        choice = slow.after_step(seconds)
    assert not choice.compiled and all(layer._compiled_call_impl is None for layer in layers)


def _trial_worker(rank: int, world_size: int, seconds: list[list[float]]) -> tuple:
    import torch.distributed as dist

    from parallel.compile import CompileTrial

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    layers = _compiled_layers(1)
    trial = CompileTrial([_Chunk(layers)], torch.device("cpu"), dist.group.WORLD)
    for s in seconds[rank]:
        choice = trial.after_step(s)
    return choice.compiled_s, choice.eager_s, choice.compiled, layers[0]._compiled_call_impl is not None


def test_auto_makes_every_rank_the_same_choice():
    """Rank 0 alone would keep the compiled layers, rank 1 alone eager ones: the slowest rank of each step decides."""
    seconds = [[9.0, 9.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 1.0], [9.0, 9.0, 3.0, 2.0, 2.0, 3.0, 3.0, 2.0, 2.0, 3.0]]
    assert run_workers(_trial_worker, 2, seconds, timeout=120) == [(3.0, 2.0, False, False)] * 2
