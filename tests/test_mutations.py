"""The equivalence and resume comparisons catch real bugs: each bug below is injected with monkeypatch into a
layout that otherwise passes, the check the suite relies on must fail, and its message must name the quantity
the bug corrupts (not just any loss difference).

Gradient-scale bugs are invisible to per-step losses and final weights alone: AdamW's first update is
lr * sign(g) and clipping removes an overall scale. Layouts stay small and in-process where possible: emulated
pp=2 in this process, and the pooled processes of world 2 for the DP and TP cases.
"""

from pathlib import Path

import pytest
import torch

from parallel import engine, grad_sync, tensor_pass
from parallel.collectives import group_size
from tests.equivalence import assert_bitwise_resume, assert_equivalent, baseline, compose_run_config, run_training
from tests.spawn import run_workers

# The module's shared runs are set up inside its first test: under load that can take minutes, so the
# per-test bound is the whole module's, not pytest.ini's 600 s for one test.
pytestmark = pytest.mark.timeout(1800)

COMMON = ["train.steps=2", "schedule.n_microbatches=2"]
DP = 2
DP2 = [f"parallel.dp={DP}"]
TP2 = ["parallel.tp=2", "schedule.n_microbatches=4"]  # the dp2 cases' global batch
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


def tp_norm_grad_not_summed(mp: pytest.MonkeyPatch) -> None:
    """The q/k norms' partial gradients (each TP rank sees its heads only) are not summed over TP."""
    mp.setattr(tensor_pass, "_all_reduce_grad", lambda grad, group: grad)


def replicas_read_one_slice(mp: pytest.MonkeyPatch) -> None:
    """Every DP replica reads replica 0's share of the global batch."""
    from training.data import StepBatches

    mp.setattr(StepBatches, "indices_at", lambda stream, position: stream._indices(position, stream.replica_batch_size))


def aux_times_dp(mp: pytest.MonkeyPatch) -> None:
    """The aux loss is scaled by 1/micro-batches of one replica instead of the global batch (x dp)."""
    scales = engine.StepScales
    mp.setattr(engine, "StepScales", lambda loss_scale, aux_scale, **kw: scales(loss_scale, aux_scale * DP, **kw))


# name -> (mutation, model, layout, what the failure must name): DP bugs need real DP processes, the others an
# emulated pipeline. The pattern shows the bug is caught by the quantity it corrupts, not by a side effect.
MUTATIONS = {
    "dp-average": (dp_average, "dense", DP2, r"grads model\.\S+ dp\d"),
    "local-token-count": (local_token_count, "padded", DP2, r"metrics\.jsonl tokens step 1: "),
    "replicas-read-one-slice": (replicas_read_one_slice, "dense", DP2, r"data step 1: the replicas read 4 micro-"),
    "tp-norm-grad-not-summed": (tp_norm_grad_not_summed, "dense", TP2,
                                r"grads model\.layers\.\d+\.self_attn\.[qk]_norm\.weight dp0 tp[01]"),
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
            grid = ParallelGrid.build(None, cfg.parallel.tp, 1, backend="gloo", timeout_s=120)
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
    spawned = [(model, tuple(layout), None) for model, layout in sorted(cases) if list(layout) in (DP2, TP2)]
    spawned += [(MUTATIONS[name][1], tuple(layout), name) for name, (_, _, layout, _) in MUTATIONS.items()
                if layout in (DP2, TP2)]
    runs_ = [([*COMMON, *MODELS[model], *layout], str(root / f"{model}-{i}-{name}"), name)
             for i, (model, layout, name) in enumerate(spawned)]
    by_rank = run_workers(mutant_worker, 2, runs_, str(cache), timeout=480)
    for i, (model, layout, name) in enumerate(spawned):
        out[name or (model, layout)] = [r[i] for r in by_rank]
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


# --- Resume: the bitwise comparison of a resumed run with the uninterrupted one. ----------------------------

RESUME = ["model=tiny", "model.dropout=0.1", "train.steps=4", "checkpoint.every=2", *PP2]  # dropout draws the RNG


def forget_data_position(mp: pytest.MonkeyPatch) -> None:
    """Resume restores weights and optimizer but not where the data stream was: it starts over."""
    from training.data import StepBatches

    mp.setattr(StepBatches, "load_state_dict", lambda stream, state: None)


def forget_rng(mp: pytest.MonkeyPatch) -> None:
    """Resume does not restore this rank's RNG state: dropout draws other masks than the uninterrupted run."""
    from checkpoint import distributed

    mp.setattr(distributed.torch, "set_rng_state", lambda state: None)


RESUME_MUTATIONS = {
    "resume-forgets-data-position": (forget_data_position, r"data step 3 of the resumed run"),
    "resume-forgets-rng": (forget_rng, r"rng state after step 3 of the resumed run"),
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """An uninterrupted dropout run, then its resume from step 2: plain and under each resume mutation."""
    from parallel.grid import ParallelGrid

    root = tmp_path_factory.mktemp("resume-mutations")
    single = ParallelGrid.single(torch.device("cpu"))
    straight = run_training(compose_run_config(RESUME, root / "cache"), single, root / "straight")
    checkpoint = root / "straight" / "checkpoints" / "step_00000002"
    out = {"straight": [straight]}
    for name in [None, *RESUME_MUTATIONS]:
        cfg = compose_run_config([*RESUME, f"checkpoint.resume={checkpoint}"], root / "cache")
        with pytest.MonkeyPatch.context() as mp:
            if name is not None:
                RESUME_MUTATIONS[name][0](mp)
            out[name] = [run_training(cfg, single, root / f"resumed-{name}")]
    return out


@pytest.mark.parametrize("name", list(RESUME_MUTATIONS))
def test_resume_check_catches_injected_bug(resumed, name):
    assert_bitwise_resume(resumed["straight"], resumed[None], start=2)  # the resume without the bug passes
    with pytest.raises(AssertionError, match=RESUME_MUTATIONS[name][1]):
        assert_bitwise_resume(resumed["straight"], resumed[name], start=2)
