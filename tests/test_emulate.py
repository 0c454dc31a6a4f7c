"""parallel.emulate=true: every pipeline rank in one process gives the per-step losses of the distributed run."""

from pathlib import Path

import pytest
import torch

from parallel.grid import ParallelGrid
from parallel.pipeline.schedules import SCHEDULES
from tests.equivalence import compose_run_config, run_training
from tests.shared import once_per_session
from tests.spawn import run_workers

COMMON = ["model=tiny", "train.steps=2", "schedule.n_microbatches=4"]
SCHEDULE_NAMES = [n for n in ("1f1b", "gpipe", "zb-h1") if n in SCHEDULES]
PP2 = [["parallel.pp=2", f"schedule.name={n}"] for n in SCHEDULE_NAMES]
PP4 = [["parallel.pp=4", f"schedule.name={n}"] for n in SCHEDULE_NAMES]
TP2_PP2 = ["parallel.tp=2", "parallel.pp=2", f"schedule.name={SCHEDULE_NAMES[-1]}"]


def losses_worker(rank: int, world_size: int, layouts: list[list[str]], cache_dir: str, run_dir: str) -> list:
    """Train each layout in turn on one process group; emulated layouts keep only dp x tp in the grid."""
    losses = []
    for i, overrides in enumerate(layouts):
        cfg = compose_run_config([*COMMON, *overrides], Path(cache_dir))
        p = cfg.parallel
        grid = ParallelGrid.build(p.dp, p.tp, 1 if p.emulate else p.pp, backend="gloo", timeout_s=60)
        losses.append(run_training(cfg, grid, Path(run_dir) / str(i))["losses"])
    return losses


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    """Per-step losses of the real multi-process runs, rank 0's view, by layout."""
    def compute(root: Path) -> dict:
        losses = {}
        for world, layouts in {2: PP2, 4: [*PP4, TP2_PP2]}.items():
            results = run_workers(losses_worker, world, layouts, str(root / "cache"), str(root / f"w{world}"),
                                  timeout=240)
            assert all(r == results[0] for r in results)  # every rank returns the same losses
            losses.update({tuple(layout): result for layout, result in zip(layouts, results[0])})
        return losses

    return once_per_session(tmp_path_factory, "emulate-distributed", compute)


def assert_same_losses(emulated: list[float], distributed: list[float]) -> None:
    # Same lists, same kernels, same data: only float64 reductions (grad norm, aux sum) run in another order.
    torch.testing.assert_close(torch.tensor(emulated, dtype=torch.float64),
                               torch.tensor(distributed, dtype=torch.float64), rtol=1e-9, atol=0)


@pytest.mark.parametrize("layout", PP2 + PP4, ids=lambda layout: "-".join(x.split("=")[1] for x in layout))
def test_emulated_pipeline_matches_distributed(layout, distributed, tmp_path):
    cfg = compose_run_config([*COMMON, *layout, "parallel.emulate=true"], tmp_path / "cache")
    result = run_training(cfg, ParallelGrid.single(torch.device("cpu")), tmp_path / "run")
    assert_same_losses(result["losses"], distributed[tuple(layout)])


def test_emulated_pipeline_under_tensor_parallel_matches_distributed(distributed, tmp_path):
    # Two processes (the TP pair), each playing both pipeline ranks of its TP coordinate.
    results = run_workers(losses_worker, 2, [[*TP2_PP2, "parallel.emulate=true"]], str(tmp_path / "cache"),
                          str(tmp_path / "run"), timeout=120)
    for result in results:
        assert_same_losses(result[0], distributed[tuple(TP2_PP2)])
