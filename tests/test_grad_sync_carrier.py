"""Where the step's loss sums ride at dp2: a model whose gradients fit one bucket keeps every gradient a float32 view
of its bucket, the sums travel in a bucket of their own (issue 39: the whole model went float64 as their carrier)."""

import dataclasses

import torch

from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from parallel.step import LocalEngine
from tests.spawn import run_workers
from tests.test_grad_sync import stamped
from tests.test_runtime import CPU, batches, layout_cfg, tiny
from training.objectives.lm import LANGUAGE_MODEL


def _one_bucket_worker(rank: int, world_size: int) -> dict:
    grid = ParallelGrid.build(2, 1, 1, backend="gloo", timeout_s=60)
    spec = dataclasses.replace(layout_cfg("1f1b", 1, 2), emulate=False)  # the default 25 MB buckets: one
    engine = ParallelEngine(spec, tiny(), grid)
    replicas = [batches(2, seed=1 + d) for d in range(2)]
    tokens = sum(mb.num_label_tokens() for replica in replicas for mb in replica)
    result = engine.step(stamped(replicas[grid.dp_rank], tokens))
    sync = engine.sync
    homes = {p.grad.untyped_storage().data_ptr(): p.grad.dtype for p in engine.parameters()}
    storages = {b.storage.untyped_storage().data_ptr() for b in sync.order if b.storage is not None}
    reference = LocalEngine(tiny(), CPU, torch.float32, LANGUAGE_MODEL).step(
        [mb for replica in replicas for mb in replica])
    return {"gradient_buckets": sum(bool(b.params) for b in sync.order), "carrier_params": len(sync.carrier.params),
            "views": set(homes) <= storages, "dtypes": set(homes.values()), "loss": result.loss,
            "reference_loss": reference.loss}


def test_the_loss_sums_ride_alone_where_the_smallest_bucket_is_large_and_gradients_stay_float32_views():
    for rank, r in enumerate(run_workers(_one_bucket_worker, 2, timeout=240)):
        assert r["gradient_buckets"] == 1 and r["carrier_params"] == 0, (rank, r)
        assert r["views"] and r["dtypes"] == {torch.float32}, f"rank {rank}: a gradient left its bucket's storage"
        assert abs(r["loss"] - r["reference_loss"]) <= 1e-6 * r["reference_loss"], r
