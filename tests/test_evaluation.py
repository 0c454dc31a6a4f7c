"""Validation loss: a forward-only pass through the same stages, transport and runtime equals one process."""

import dataclasses

import pytest
import torch

from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from parallel.step import LocalEngine
from tests.spawn import run_workers
from tests.test_runtime import CPU, batches, layout_cfg, tiny
from training.objectives.lm import LANGUAGE_MODEL


def reference_loss(m: int) -> float:
    return LocalEngine(tiny(), CPU, torch.float32, LANGUAGE_MODEL).evaluate(batches(m)).loss


@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)])
def test_emulated_evaluation_equals_one_process(schedule, vpp):
    engine = ParallelEngine(layout_cfg(schedule, 2, 4, vpp=vpp), tiny(), ParallelGrid.single(CPU))
    result = engine.evaluate(batches(4))
    assert result.loss == pytest.approx(reference_loss(4), rel=1e-6)
    assert all(p.grad is None for p in engine.parameters())  # nothing was kept for a backward
    assert all(not stage.saved for stage in engine.stages.values())
    engine.step(batches(4))  # training still works after an evaluation (modules back in train mode)
    assert all(stage.module.training for stage in engine.stages.values())


def _tp2_pp2_eval_worker(rank: int, world_size: int) -> float:
    grid = ParallelGrid.build(1, 2, 2, backend="gloo", timeout_s=60)
    engine = ParallelEngine(dataclasses.replace(layout_cfg("1f1b", 2, 4), emulate=False), tiny(), grid)
    return engine.evaluate(batches(4)).loss


def test_tp2_pp2_validation_loss_equals_one_process():
    losses = run_workers(_tp2_pp2_eval_worker, 4, timeout=180)
    for loss in losses:
        assert loss == pytest.approx(reference_loss(4), rel=1e-5)
