"""An objective is the caller's: one written here, reading a per-row weight from its micro-batches' payload
(`MicroBatch.extra`), trains and evaluates through a pipeline as in one process with no change to `parallel/`, and
the payload reaches it untouched; the reference pass (training/objectives/reference.py) is the engine's generic
forward-only pass and gives one process's values through a pipeline."""

import dataclasses

import pytest
import torch

from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from parallel.step import LocalEngine, MicroBatch, TokenLoss
from tests.test_runtime import CPU, assert_grads_match, batches, layout_cfg, tiny
from training.objectives.lm import LANGUAGE_MODEL, sequence_logps
from training.objectives.reference import row_logps


class RowWeightedLoss:
    """Each row's next-token loss sum times the row's weight in `extra["weight"]`, a mean over label tokens; its
    second sum is the weighted loss of the rows weighted above 1 (a metric of its own). It keeps every payload
    tensor it is handed, to show they are the data layer's own objects."""

    width = 2

    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor],
                 token_loss: TokenLoss) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append(extra["weight"])
        weighted = -sequence_logps(logits, labels, token_loss) * extra["weight"]
        loss_sum = weighted.sum()
        return loss_sum, torch.stack([loss_sum, weighted[extra["weight"] > 1].sum()]).detach()

    def count(self, micro_batch: MicroBatch) -> torch.Tensor:
        return micro_batch.label_tokens()

    def metrics(self, sums: list[float], count: int) -> dict[str, float]:
        return {"heavy": sums[1] / max(count, 1)}


def weighted(micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    """The micro-batches with a weight per row in their payload (0.5, 2, 0.5, 2, ...)."""
    return [dataclasses.replace(mb, extra={"weight": torch.tensor([0.5, 2.0] * (len(mb.input_ids) // 2))})
            for mb in micro_batches]


def test_an_objective_of_its_own_reaches_the_last_stage_with_its_payload_untouched():
    data = weighted(batches(4))
    alone, single = RowWeightedLoss(), tiny()
    want = LocalEngine(single, CPU, torch.float32, alone).step(data)
    grads = {name: p.grad for name, p in single.module.named_parameters()}
    assert want.metrics["heavy"] > want.loss / 2  # the weights entered the loss: rows weighted 2 carry 4/5 of it

    piped = RowWeightedLoss()
    spec = dataclasses.replace(layout_cfg("zbv", 2, 4, vpp=2), objective=piped)  # V placement, split backward
    engine = ParallelEngine(spec, tiny(), ParallelGrid.single(CPU))
    got = engine.step(data)
    assert got.loss == pytest.approx(want.loss, rel=1e-6) and got.tokens == want.tokens
    assert got.metrics["heavy"] == pytest.approx(want.metrics["heavy"], rel=1e-6)
    assert_grads_match(engine, grads)
    assert [id(t) for t in piped.seen] == [id(mb.extra["weight"]) for mb in data]  # each once, the same object

    evaluated = engine.evaluate(data)
    assert evaluated.loss == pytest.approx(LocalEngine(tiny(), CPU, torch.float32, alone).evaluate(data).loss,
                                           rel=1e-6)


@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_the_reference_pass_through_a_pipeline_gives_one_process_values(schedule, vpp):
    data = batches(4)
    want = row_logps(LocalEngine(tiny(), CPU, torch.float32, LANGUAGE_MODEL), data)
    engine = ParallelEngine(layout_cfg(schedule, 2, 4, vpp=vpp), tiny(), ParallelGrid.single(CPU))
    got = row_logps(engine, data)
    assert got.shape == (8,) and got.dtype == torch.float64 and bool((want < 0).all())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert all(not mb.extra for mb in data)  # the rows' places went into copies, not into the caller's batches
