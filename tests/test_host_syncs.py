"""The step reads the device back to the host a fixed, small number of times (issue 37 item 1).

A forced host read (`Tensor.item / tolist / cpu`, `bool / float / int` of a tensor) waits for every kernel queued
before it on a GPU. Counted here on CPU by patching those methods, per training step of the real loop:
- 2 on a non-logging step of any layout: the engine's `read_back` (the loss and metric sums, the token count when
  the data did not stamp it) and the non-finite vote's (its flags, the stop signal and the grad norm, which the
  clipping before it never read: it clips on the device);
- plus one counts read per MoE layer and micro-batch in the forward (MiniMind's expert loop, or the EP dispatch's
  split sizes): a data-dependent split needs host sizes; its indices are built on the device. (MiniMind's loop used
  to count 0 here while syncing once per expert inside torch.where, which sizes its output from the data.)
Not counted, as they read host memory, not the device: the data layer's host batches (before their copy) and
torch AdamW's `step` counters (host tensors unless fused, and the fused CUDA kernel reads none).
"""

from collections import Counter
from pathlib import Path

import pytest
import torch

from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from tests.equivalence import EMU, compose_run_config
from tests.spawn import run_workers
from tests.test_runtime import CPU, batches, layout_cfg, tiny

ROOT = Path(__file__).resolve().parents[1]
READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__")
HOST_ONLY = ("training/data/",)  # reads of host batches before they are copied to the device
STEP = 2  # steps=3, log_every=100: step 1 (the first) and 3 (the last) log, step 2 does not
SYNCS = Counter({"parallel/step.py:read_back": 1, "training/reliability/nonfinite.py:step_vote": 1})


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


def reads_in_training_step(overrides: list[str], cache_dir: Path, run_dir: Path, grid: ParallelGrid) -> Counter:
    """Sluice's own forced host reads from the start of training step STEP to the start of the next, by
    `file:function` of the caller."""
    from training.trainer import Trainer

    cfg = compose_run_config(["model=tiny", "train.steps=3", "train.log_every=100", *overrides], cache_dir)
    trainer = Trainer(cfg, grid, run_dir)
    current, reads = [0], Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    begin = trainer.guard.begin

    def begin_step(step: int) -> None:
        current[0] = step
        begin(step)

    trainer.guard.begin = begin_step

    def counting(name: str):
        def read(self, *args, **kwargs):
            caller = sys_frame(1)
            path = Path(caller.f_code.co_filename).resolve()
            if current[0] == STEP and path.is_relative_to(ROOT) and ".venv" not in path.parts:
                where = path.relative_to(ROOT).as_posix()
                if not where.startswith(HOST_ONLY):
                    reads[f"{where}:{caller.f_code.co_name}"] += 1
            return originals[name](self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        trainer.fit()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return reads


def sys_frame(depth: int):
    """The frame `depth` levels above the caller (the code that called the patched Tensor method)."""
    import sys

    return sys._getframe(depth + 1)


def moe_reads(where: str, layers: int, micro_batches: int) -> Counter:
    """The expected step reads of a MoE run: one counts read per layer and micro-batch at `where`."""
    return SYNCS + Counter({where: layers * micro_batches})


MOE_LOOP = "minimind/model.py:forward"


@pytest.mark.parametrize("overrides,expected", [
    ([], SYNCS),
    (["parallel.pp=2", "schedule=1f1b", EMU], SYNCS),
    (["model.use_moe=true", "schedule.n_microbatches=2"], moe_reads(MOE_LOOP, 4, 2)),
], ids=["dense", "pp2-1f1b-emu", "moe"])
def test_training_step_reads_the_device_twice(data_cache, tmp_path, overrides, expected):
    reads = reads_in_training_step(overrides, data_cache, tmp_path / "run", ParallelGrid.single(CPU))
    assert reads == expected


def world_reads(rank: int, world_size: int, runs: list[list[str]], cache_dir: str, run_dir: str) -> list[Counter]:
    """Spawned body: each run's step reads on this rank (the grid has no pipeline axis when emulated)."""
    from tests.equivalence import compose_run_config as compose

    counted = []
    for i, overrides in enumerate(runs):
        p = compose(overrides, Path(cache_dir)).parallel
        grid = ParallelGrid.build(p.dp, p.tp, 1 if p.emulate else p.pp, backend="gloo", timeout_s=120, ep=p.ep)
        counted.append(reads_in_training_step(overrides, Path(cache_dir), Path(run_dir) / f"{i}-{rank}", grid))
    return counted


def test_dp2_and_ep2_steps_read_the_device_twice_plus_the_dispatch(data_cache, tmp_path):
    runs = [["parallel.dp=2", "parallel.pp=2", "schedule=1f1b", EMU],
            ["parallel.dp=2", "parallel.ep=2", "model.use_moe=true", "schedule.n_microbatches=2"]]
    results = run_workers(world_reads, 2, runs, str(data_cache), str(tmp_path), timeout=300)
    for rank in results:
        assert rank == [SYNCS, moe_reads("parallel/expert.py:routing_of", 4, 2)]
