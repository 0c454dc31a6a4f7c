"""ParallelGrid: coordinates follow rank = tp + TP*(dp + DP*pp); groups hold the right ranks and work."""

import threading

import pytest
import torch
import torch.distributed as dist

from parallel.grid import ParallelGrid
from tests.spawn import run_workers


def _grid_worker(rank: int, world_size: int, pp: int, dp: int, tp: int) -> dict:
    grid = ParallelGrid.build(dp=None, tp=tp, pp=pp, backend="gloo", timeout_s=60)
    groups = {name: getattr(grid, f"{name}_group") for name in ("tp", "dp", "pp", "mp", "embed")}
    members = {name: dist.get_process_group_ranks(g) if g is not None else None for name, g in groups.items()}
    # Each group must also work: the sum of members' ranks.
    sums = {}
    for name, g in groups.items():
        if g is not None:
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=g)
            sums[name] = value.item()
    return {"coords": (grid.pp_rank, grid.dp_rank, grid.tp_rank), "sizes": (grid.pp, grid.dp, grid.tp),
            "rank": grid.rank, "members": members, "sums": sums,
            "mesh_shape": tuple(grid.mesh.shape), "backend": grid.backend}


def test_grid_world8_pp2_dp2_tp2():
    pp, dp, tp = 2, 2, 2
    results = run_workers(_grid_worker, 8, pp, dp, tp, timeout=180)

    def rank_of(p: int, d: int, t: int) -> int:
        return t + tp * (d + dp * p)

    for rank, r in enumerate(results):
        p, d, t = r["coords"]
        assert rank_of(p, d, t) == rank == r["rank"]
        assert r["sizes"] == (pp, dp, tp) and r["mesh_shape"] == (pp, dp, tp) and r["backend"] == "gloo"
        expected = {
            "tp": [rank_of(p, d, x) for x in range(tp)],
            "dp": [rank_of(p, x, t) for x in range(dp)],
            "pp": [rank_of(x, d, t) for x in range(pp)],
            "mp": sorted(rank_of(x, d, y) for x in range(pp) for y in range(tp)),
            "embed": [rank_of(0, d, t), rank_of(pp - 1, d, t)],
        }
        for name, ranks in expected.items():
            assert sorted(r["members"][name]) == ranks, (rank, name)
            assert r["sums"][name] == sum(ranks), (rank, name)
    assert len({r["coords"] for r in results}) == 8


def test_world_size_mismatch_fails_before_rendezvous(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=r"world size 8 != parallel.dp\*tp\*pp = 2\*2\*1; launch 4 processes"):
        ParallelGrid.build(dp=2, tp=2, pp=1, backend="gloo", timeout_s=60)
    with pytest.raises(ValueError, match=r"world size 8 is not a multiple of parallel.tp\*pp = 3\*1"):
        ParallelGrid.build(dp=None, tp=3, pp=1, backend="gloo", timeout_s=60)
    assert not dist.is_initialized()


def test_single_grid_has_no_groups():
    grid = ParallelGrid.single("cpu")
    assert (grid.pp, grid.dp, grid.tp, grid.world_size, grid.rank) == (1, 1, 1, 1, 0)
    assert all(g is None for g in (grid.tp_group, grid.dp_group, grid.pp_group, grid.mp_group, grid.embed_group))
    assert grid.mesh is None and grid.global_rank_of(0, 0, 0) == 0



def _ok_worker(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


def _failing_worker(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("boom from rank 1")
    return rank


def _hanging_worker(rank: int, world_size: int) -> int:
    if rank == 1:
        threading.Event().wait()  # never set: this rank hangs until killed
    return rank


def test_run_workers_returns_by_rank_and_surfaces_errors_and_hangs():
    assert run_workers(_ok_worker, 2) == [(0, 2), (1, 2)]
    # Fresh processes for the failing jobs: a failure discards the pool it ran on, and the session's serves others.
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*KeyError: 'boom from rank 1'"):
        run_workers(_failing_worker, 2, fresh=True)
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 3s"):
        run_workers(_hanging_worker, 2, timeout=3, fresh=True)
    assert run_workers(_ok_worker, 2) == [(0, 2), (1, 2)]  # the session's pool still serves
