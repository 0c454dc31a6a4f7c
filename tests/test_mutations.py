"""The equivalence comparison catches gradient-scale bugs: each bug below is injected with monkeypatch into
a layout that otherwise passes, and `assert_equivalent` (the equivalence tests' own check) must fail.

These bugs are invisible to per-step losses and final weights alone: AdamW's first update is lr * sign(g)
and clipping removes an overall scale. Layouts stay small and in-process where possible: emulated pp=2 in
this process, and one spawn of two processes (dp=2) for every DP case.
"""

from pathlib import Path

import pytest
import torch

from parallel import engine, grad_sync
from parallel.collectives import group_size
from tests.equivalence import assert_equivalent, baseline, compose_run_config, run_training
from tests.spawn import run_workers

COMMON = ["train.steps=2", "schedule.n_microbatches=2"]
DP = 2
DP2 = [f"parallel.dp={DP}"]
PP2 = ["parallel.pp=2", "parallel.emulate=true", "schedule.n_microbatches=4"]  # the dp2 cases' global batch
MODELS = {"dense": ["model=tiny"], "padded": ["model=tiny", "data.format=padded", "train.seq_len=128"],
          "moe": ["model=tiny-moe"]}  # moe: top-1, so the router learns only through the aux loss


def dp_average(mp: pytest.MonkeyPatch) -> None:
    """DP gradient sync averages instead of summing (every bucket's chain ends with the DP sum)."""
    unflatten = grad_sync.Bucket.unflatten

    def averaged(bucket: grad_sync.Bucket) -> None:
        bucket.flat /= group_size(bucket.groups[-1])
        unflatten(bucket)

    mp.setattr(grad_sync.Bucket, "unflatten", averaged)


def local_token_count(mp: pytest.MonkeyPatch) -> None:
    """The loss is scaled by this replica's label tokens: the data layer stamps its own share as the global count."""
    from training.data import StepBatches

    mp.setattr(StepBatches, "global_tokens_at",
               lambda stream, position: int(stream.samples.label_counts(stream.indices_at(position)).sum()))


def tied_average(mp: pytest.MonkeyPatch) -> None:
    """The tied embedding's two copies are averaged instead of summed (halved, then summed)."""
    sum_local_tie = grad_sync.GradientSync._sum_local_tie

    def averaged(sync: grad_sync.GradientSync) -> None:
        for param in sync.local_tie:
            param.grad = param.grad / 2
        sum_local_tie(sync)

    mp.setattr(grad_sync.GradientSync, "_sum_local_tie", averaged)


def norm_double_count(mp: pytest.MonkeyPatch) -> None:
    """The grad norm counts the last stage's copy of the tied embedding as well as the first stage's."""
    norm_parameters = engine.ParallelEngine.norm_parameters

    def counted_twice(eng: engine.ParallelEngine) -> list:
        params = norm_parameters(eng)
        return params + [eng.head] if eng.head is not None and all(p is not eng.head for p in params) else params

    mp.setattr(engine.ParallelEngine, "norm_parameters", counted_twice)


def aux_times_dp(mp: pytest.MonkeyPatch) -> None:
    """The aux loss is scaled by 1/micro-batches of one replica instead of the global batch (x dp)."""
    step_plan = engine.StepPlan
    mp.setattr(engine, "StepPlan", lambda loss_scale, aux_scale, **kw: step_plan(loss_scale, aux_scale * DP, **kw))


# name -> (mutation, model, layout, what the failure must name): DP bugs need real DP processes, the others an
# emulated pipeline. The pattern shows the bug is caught by the quantity it corrupts, not by a side effect.
MUTATIONS = {
    "dp-average": (dp_average, "dense", DP2, r"grads model\.\S+ dp1"),
    "local-token-count": (local_token_count, "padded", DP2, r"loss on rank"),
    "aux-scaled-by-dp": (aux_times_dp, "moe", DP2, r"grads model\.layers\.\d+\.mlp\.gate\.weight"),
    "tied-average": (tied_average, "dense", PP2, r"grads (model\.embed_tokens|lm_head)\.weight"),
    "norm-double-count": (norm_double_count, "dense", PP2, r"metrics\.jsonl grad_norm"),
}


def mutant_worker(rank: int, world_size: int, runs: list[tuple[list[str], str, str | None]], cache_dir: str) -> list:
    """Spawned body: train each run with its mutation (None = control) patched in for that run only."""
    from parallel.grid import ParallelGrid

    results = []
    for overrides, run_dir, mutation in runs:
        cfg = compose_run_config(overrides, Path(cache_dir))
        with pytest.MonkeyPatch.context() as mp:
            if mutation is not None:
                MUTATIONS[mutation][0](mp)
            grid = ParallelGrid.build(cfg.parallel.dp, cfg.parallel.tp, 1, backend="gloo", timeout_s=120)
            results.append(run_training(cfg, grid, Path(run_dir)))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Baselines, controls and mutants: (model, layout) -> control results and mutation -> mutant results."""
    from parallel.grid import ParallelGrid

    root = tmp_path_factory.mktemp("mutations")
    cache = root / "cache"
    cases = {(model, tuple(layout)) for _, model, layout, _ in MUTATIONS.values()}
    out = {"baseline": {model: baseline([*COMMON, *MODELS[model]], cache, root / f"base-{model}", dp=2)
                        for model in {m for m, _ in cases}}}
    spawned = [(model, None) for model, layout in sorted(cases) if list(layout) == DP2]
    spawned += [(MUTATIONS[name][1], name) for name, (_, _, layout, _) in MUTATIONS.items() if layout == DP2]
    runs_ = [([*COMMON, *MODELS[model], *DP2], str(root / f"{model}-{name}"), name) for model, name in spawned]
    by_rank = run_workers(mutant_worker, 2, runs_, str(cache), timeout=480)
    for i, (model, name) in enumerate(spawned):
        out[name or (model, tuple(DP2))] = [r[i] for r in by_rank]
    for name in [None, *(n for n, (_, _, layout, _) in MUTATIONS.items() if layout == PP2)]:
        cfg = compose_run_config([*COMMON, *MODELS["dense"], *PP2], cache)
        with pytest.MonkeyPatch.context() as mp:
            if name is not None:
                MUTATIONS[name][0](mp)
            out[name or ("dense", tuple(PP2))] = [run_training(cfg, ParallelGrid.single(torch.device("cpu")),
                                                               root / f"pp2-{name}")]
    return out


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_equivalence_check_catches_injected_bug(runs, name):
    _, model, layout, names = MUTATIONS[name]
    reference = runs["baseline"][model]
    assert_equivalent(runs[(model, tuple(layout))], reference)  # the same layout without the bug passes
    with pytest.raises(AssertionError, match=names):
        assert_equivalent(runs[name], reference)
