"""Data-parallel gradient sync: no DP collective but one per bucket, started during the backward; ZeRO-1 state."""

import contextlib
import dataclasses
import gc
import inspect
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from parallel.step import LocalEngine, MicroBatch
from tests.spawn import run_workers
from tests.test_runtime import CPU, batches, layout_cfg, tiny
from training.objectives.lm import LANGUAGE_MODEL
from training.data import IGNORE_INDEX, Documents, PackedSamples, PaddedSamples, StepBatches, TensorSamples


COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
               "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce", "broadcast",
               "broadcast_object_list", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
               "scatter_object_list", "barrier", "monitored_barrier")


@contextlib.contextmanager
def counting_collectives(calls: list[tuple[str, object]]):
    """Record (name, group) of every collective issued, whether called as `dist.x` or inside torch.distributed."""
    patched = []
    for module in (dist, dist.distributed_c10d):
        for name in COLLECTIVES:
            original = getattr(module, name, None)
            if original is None:
                continue
            signature = inspect.signature(original)

            def counted(*args, _name=name, _original=original, _signature=signature, **kwargs):
                calls.append((_name, _signature.bind_partial(*args, **kwargs).arguments.get("group")))
                return _original(*args, **kwargs)

            patched.append((module, name, original))
            setattr(module, name, counted)
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def stamped(micro_batches: list[MicroBatch], tokens: int) -> list[MicroBatch]:
    """The micro-batches as the data layer hands them: each carries the global batch's label-token count."""
    return [dataclasses.replace(mb, global_tokens=tokens) for mb in micro_batches]


def _dp2_pp2_worker(rank: int, world_size: int, bucket_mb: float) -> dict:
    """One step of dp2 x pp2 (1F1B, tied embeddings), counting every collective this rank issues, by group."""
    grid = ParallelGrid.build(2, 1, 2, backend="gloo", timeout_s=60)
    spec = dataclasses.replace(layout_cfg("1f1b", 2, 4), emulate=False, bucket_mb=bucket_mb)
    engine = ParallelEngine(spec, tiny(), grid)
    replicas = [batches(4, seed=1 + d) for d in range(2)]
    tokens = sum(mb.num_label_tokens() for replica in replicas for mb in replica)
    calls: list[tuple[str, object]] = []
    with counting_collectives(calls):
        result = engine.step(stamped(replicas[grid.dp_rank], tokens))
    grads = {n: p.grad.clone() for n, p in engine.named_parameters().items()}
    # Every bucket but the float64 carrier reduces its gradients where they live: views of its flat storage.
    in_place = all(p.grad.untyped_storage().data_ptr() == b.storage.untyped_storage().data_ptr()
                   for b in engine.sync.order if b is not engine.sync.carrier for p in b.params)
    for p in engine.parameters():
        p.grad = None
    unstamped = engine.step(replicas[grid.dp_rank])  # the token count by a DP all-reduce instead
    reference = LocalEngine(tiny(), CPU, torch.float32, LANGUAGE_MODEL).step(
        [mb for replica in replicas for mb in replica])
    sync = engine.sync
    report = {"dp_calls": sum(g is grid.dp_group for _, g in calls), "world_calls": sum(g is None for _, g in calls),
              "buckets": len(sync.order), "params": len(engine.parameters()),
              "dp_buckets": sum(grid.dp_group in b.groups for b in sync.order),
              "overlap": sync.first_launch_s < sync.last_backward_end_s,
              "loss": result.loss, "unstamped_loss": unstamped.loss, "reference_loss": reference.loss,
              "tokens": (result.tokens, tokens), "in_place": in_place, "same_grads": all(torch.equal(g, engine.named_parameters()[n].grad)
                                                                   for n, g in grads.items())}
    # A dropped engine is collected with its parameters and grid: the bucket hooks it registers must not tie it
    # to its parameters through C++ (a second Trainer in one process would otherwise keep the first alive).
    dropped = weakref.ref(engine)
    del engine, sync
    gc.collect()
    report["engine_collected"] = dropped() is None
    return report


def test_a_step_issues_no_dp_collective_but_its_buckets_and_they_start_inside_the_backward():
    results = run_workers(_dp2_pp2_worker, 4, 0.005, timeout=240)  # ~5 KiB buckets: several per stage
    for rank, r in enumerate(results):
        assert 1 < r["buckets"] < r["params"], r
        # Every DP collective of the step is a bucket's (the tied one after its embedding-group sum): the
        # global label count comes with the data and the loss/aux sums ride in a bucket.
        assert r["world_calls"] == 0 and r["dp_calls"] == r["dp_buckets"] <= r["buckets"], (rank, r)
        assert r["overlap"], f"rank {rank}: the first DP reduction started only after the last backward ended"
        assert r["tokens"][0] == r["tokens"][1], r
        assert r["in_place"], f"rank {rank}: a bucket copied its gradients instead of reducing them as views"
        # The numbers: the stamped count gives bit for bit what the counting all-reduce gives, and both the
        # loss of one process accumulating over both replicas' micro-batches.
        assert r["same_grads"] and r["loss"] == r["unstamped_loss"], r
        assert abs(r["loss"] - r["reference_loss"]) <= 1e-6 * r["reference_loss"], r
        assert r["engine_collected"], f"rank {rank}: a dropped ParallelEngine stayed alive (a reference cycle)"


def _zero_worker(rank: int, world_size: int, zero: int) -> dict:
    """Three AdamW steps at dp2 on replica-specific gradients; the optimizer state bytes this rank holds."""
    from training.optim import build_optimizer

    grid = ParallelGrid.build(2, 1, 1, backend="gloo", timeout_s=60)
    model = tiny().module
    cfg = OmegaConf.create({"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01})
    optimizer = build_optimizer(list(model.parameters()), cfg, grid.dp_group, zero=zero)
    for step in range(3):
        batch: MicroBatch = batches(1, seed=10 * step + grid.dp_rank)[0]
        loss = model(input_ids=batch.input_ids, labels=batch.labels).loss
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=grid.dp_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    local = optimizer.optim if zero else optimizer
    state_bytes = sum(t.numel() * t.element_size() for s in local.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "state_bytes": state_bytes}


def test_zero1_shards_optimizer_state_and_keeps_the_numbers():
    plain = run_workers(_zero_worker, 2, 0, timeout=180)
    sharded = run_workers(_zero_worker, 2, 1, timeout=180)
    for rank in (0, 1):
        for name, value in plain[rank]["params"].items():
            torch.testing.assert_close(sharded[rank]["params"][name], value, rtol=1e-6, atol=0, msg=name)
        assert sharded[rank]["state_bytes"] <= 0.55 * plain[rank]["state_bytes"], (rank, sharded[rank], plain[rank])


def _documents(masked: bool) -> Documents:
    """60 documents of 3..40 tokens; the pad id 0 occurs inside texts; a random label mask when `masked`."""
    gen = np.random.default_rng(0)
    lengths = gen.integers(3, 40, 60)
    tokens = gen.integers(0, 50, int(lengths.sum())).astype(np.uint16)
    mask = gen.integers(0, 2, len(tokens)).astype(np.uint8) if masked else None
    return Documents(tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), mask)


@pytest.mark.parametrize("kind", ["packed", "packed-masked", "padded", "padded-masked", "tensor"])
def test_data_layer_stamps_the_global_label_count_of_every_step(kind):
    """What the engine no longer all-reduces: every replica's stamp equals the sum of all replicas' label tokens."""
    docs = _documents(kind.endswith("masked"))
    if kind.startswith("packed"):
        samples = PackedSamples(docs, 16)
    elif kind.startswith("padded"):
        samples = PaddedSamples(docs, 16, pad_id=0, eos_id=1)
    else:
        labels = torch.randint(0, 50, (40, 16), generator=torch.Generator().manual_seed(0))
        samples = TensorSamples(labels.clone(), labels.masked_fill(labels < 10, IGNORE_INDEX))
    replicas = [StepBatches(samples, 2, 3, dp_rank=d, dp_size=2, seed=5) for d in range(2)]
    for step in range(len(samples) // 12 + 2):  # past an epoch boundary
        steps = [r.batch(step) for r in replicas]
        counted = sum(mb.num_label_tokens() for micro_batches in steps for mb in micro_batches)
        assert {mb.global_tokens for micro_batches in steps for mb in micro_batches} == {counted}, (kind, step)


def _dp1_pp2_worker(rank: int, world_size: int) -> dict:
    """One 1F1B step at pp2 (dp 1), counting the collectives this rank issues, by group."""
    grid = ParallelGrid.build(1, 1, 2, backend="gloo", timeout_s=60)
    engine = ParallelEngine(dataclasses.replace(layout_cfg("1f1b", 2, 4), emulate=False), tiny(), grid)
    micro = batches(4, seed=3)
    calls: list[tuple[str, object]] = []
    with counting_collectives(calls):
        result = engine.step(stamped(micro, sum(mb.num_label_tokens() for mb in micro)))
    reference = LocalEngine(tiny(), CPU, torch.float32, LANGUAGE_MODEL).step(micro)
    sync = engine.sync
    groups = {id(grid.pp_group): "pp", id(grid.embed_group): "embed"}
    return {"calls": sorted((name, groups.get(id(g), str(g))) for name, g in calls), "loss": result.loss,
            "reference_loss": reference.loss, "early": sync.sums_launch_s is not None
            and sync.sums_launch_s < sync.last_backward_end_s}


def test_at_dp1_the_loss_sums_cross_the_pipeline_while_the_backward_still_runs():
    """gloo: the one pipeline all-reduce of the loss and aux sums starts after a rank's last F, so the step's
    end does not wait for a collective; the loss is the single process's."""
    for rank, r in enumerate(run_workers(_dp1_pp2_worker, 2, timeout=180)):
        # The tied embedding's gradient sum, and the loss sums: nothing else.
        assert r["calls"] == [("all_reduce", "embed"), ("all_reduce", "pp")], (rank, r)
        assert r["early"], f"rank {rank}: the loss sums went over the pipeline only after the last backward"
        assert abs(r["loss"] - r["reference_loss"]) <= 1e-6 * r["reference_loss"], r
