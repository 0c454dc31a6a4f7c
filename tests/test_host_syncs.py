"""The hot path reads nothing back to the host per micro-batch: the count of reads is the same at m=4 and m=16."""

import pytest
import torch

from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from tests.test_runtime import CPU, batches, layout_cfg, tiny


def host_reads_in_one_step(monkeypatch, schedule: str, m: int) -> int:
    """Tensor.item / .cpu / .tolist calls during one emulated pp2 step of `schedule` with m micro-batches."""
    engine = ParallelEngine(layout_cfg(schedule, 2, m), tiny(), ParallelGrid.single(CPU))
    data = batches(m)
    count = 0
    for name in ("item", "cpu", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            nonlocal count
            count += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    engine.step(data)
    monkeypatch.undo()
    return count


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_host_reads_do_not_grow_with_micro_batches(monkeypatch, schedule):
    few, many = host_reads_in_one_step(monkeypatch, schedule, 4), host_reads_in_one_step(monkeypatch, schedule, 16)
    assert few == many <= 2, (few, many)
