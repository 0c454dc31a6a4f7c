"""The cost model of a layout: simulated step with per-stage costs, communication, memory per rank."""

import dataclasses

import pytest

from parallel.pipeline.partition import balanced_partition
from tests.equivalence import compose_run_config
from training.layout_search.costs import Fit, MeasuredCosts
from training.layout_search.predict import Candidate, candidate_of, live_peak, predict

MODES = ("none", "full", "selective")


def fake_costs(**changes) -> MeasuredCosts:
    """Round numbers: a layer F=1 B=2 I=1 W=1 s, no embedding/head time, no communication, 100 B saved."""
    base = MeasuredCosts(key={"micro_batch_size": 2, "backend": "gloo"}, layer_f=1.0,
                         layer_b=dict.fromkeys(MODES, 2.0), layer_i=dict.fromkeys(MODES, 1.0), layer_w=1.0,
                         embed_f=0.0, embed_b=0.0, embed_i=0.0, embed_w=0.0, head_f=0.0, head_b=0.0, head_i=0.0,
                         head_w=0.0, layer_saved={"none": 100, "full": 10, "selective": 60}, layer_deferred=50,
                         embed_saved=0, embed_deferred=0, head_saved=0, head_deferred=0, layer_params=1000,
                         embed_params=0, head_params=0, param_bytes=4, optimizer_s_per_param=0.0,
                         boundary_bytes=1000, p2p=Fit(0.0, 0.0), allreduce=Fit(0.0, 0.0))
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return compose_run_config(["model=tiny", "model.num_hidden_layers=4", "train.micro_batch_size=2"],
                              tmp_path_factory.mktemp("cache"))


def pp2(schedule: str, m: int = 4, recompute: str = "none", **kw) -> Candidate:
    return Candidate(dp=1, tp=1, pp=2, vpp=1, schedule=schedule, n_microbatches=m, micro_batch_size=2,
                     recompute=recompute, **kw)


def test_1f1b_step_is_the_textbook_makespan_scaled_by_layers(cfg):
    got = predict(pp2("1f1b"), cfg, fake_costs())
    assert got.step_s == pytest.approx(2 * 3.0 * (4 + 2 - 1))  # 2 layers per stage, (F+B)(m+pp-1)
    # Parameters: 2 layers x 1000 x (param + grad + 2 AdamW states = 16 B); activations: 1F1B holds 2 and 1.
    assert got.peak_bytes == (2000 * 16 + 2 * 200, 2000 * 16 + 1 * 200)


def test_gpipe_holds_every_microbatch_and_recompute_shrinks_it(cfg):
    assert predict(pp2("gpipe"), cfg, fake_costs()).peak_bytes == (32000 + 4 * 200,) * 2
    assert predict(pp2("gpipe", recompute="full"), cfg, fake_costs()).peak_bytes == (32000 + 4 * 20,) * 2


def test_zero_bubble_counts_what_waits_for_w(cfg):
    got = predict(pp2("zb-h1"), cfg, fake_costs())
    ranks = got.sim.actions
    assert got.peak_bytes == tuple(32000 + live_peak(r, (200, 200), (100, 100)) for r in ranks)
    assert live_peak([("F",)] * 0, (), ()) == 0
    assert got.step_s < predict(pp2("1f1b"), cfg, fake_costs()).step_s


def test_a_heavy_head_slows_the_last_stage_and_a_lighter_split_recovers(cfg):
    heavy = fake_costs(head_f=2.0, head_b=4.0, head_i=2.0, head_w=2.0)  # the head costs two layers
    even = predict(pp2("1f1b", m=8), cfg, heavy).step_s
    split = balanced_partition(4, 2, 3.0, 0.0, 6.0)
    assert split == [3, 1] and balanced_partition(4, 2, 3.0, 0.0, 3.0) == [2, 2]  # a tie stays even
    assert predict(pp2("1f1b", m=8, layers_per_stage=tuple(split)), cfg, heavy).step_s < even


def test_tp_halves_compute_and_pays_its_all_reduces(cfg):
    one = Candidate(1, 1, 1, 1, "1f1b", 4, 2, "none")
    two = dataclasses.replace(one, tp=2)
    free = predict(two, cfg, fake_costs()).step_s
    assert free == pytest.approx(predict(one, cfg, fake_costs()).step_s / 2)
    paid = predict(two, cfg, fake_costs(allreduce=Fit(0.01, 0.0))).step_s
    # Per micro-batch, in F and again in B: two per layer, one for the embedding, one for the head.
    assert paid == pytest.approx(free + 4 * 2 * (2 * 4 + 2) * 0.01)


def test_dp_pays_one_gradient_all_reduce_and_the_optimizer_its_step(cfg):
    one = Candidate(1, 1, 1, 1, "1f1b", 4, 2, "none")
    base = predict(one, cfg, fake_costs()).step_s
    dp = predict(dataclasses.replace(one, dp=2), cfg, fake_costs(allreduce=Fit(0.5, 0.0))).step_s
    assert dp == pytest.approx(base + 0.5)  # 16 KB of gradients: one bucket
    opt = predict(one, cfg, fake_costs(optimizer_s_per_param=1e-3)).step_s
    assert opt == pytest.approx(base + 4000 * 1e-3)


def test_candidate_overrides_and_the_config_round_trip(cfg):
    c = pp2("zb-h1", m=8, layers_per_stage=(3, 1))
    assert c.overrides() == ["parallel.dp=1", "parallel.tp=1", "parallel.pp=2", "parallel.vpp=1", "schedule=zb-h1",
                             "schedule.n_microbatches=8", "train.micro_batch_size=2", "train.recompute=none",
                             "parallel.layers_per_stage=[3,1]"]
    assert candidate_of(cfg) == Candidate(1, 1, 1, 1, "1f1b", 4, 2, "none")


def test_the_fixed_part_of_a_piece_does_not_scale_with_the_micro_batch(cfg):
    """t(b) = a + c b from times at b and 2b: a pipeline of half-size micro-batches pays a in full."""
    from training.layout_search.costs import fixed_parts

    assert fixed_parts({"layer_f": 1.0}, {"layer_f": 1.6}) == {"layer_f": pytest.approx(0.4)}
    assert fixed_parts({"layer_f": 1.0}, {"layer_f": 2.5}) == {"layer_f": 0.0}  # superlinear: clamped
    costs = fake_costs(fixed={"layer_f": 0.5, "layer_b.none": 1.0})
    half = dataclasses.replace(pp2("1f1b", m=8), micro_batch_size=1)
    got = predict(half, cfg, costs)
    f, b = 0.5 + 0.5 * 0.5, 1.0 + 1.0 * 0.5  # fixed + scaled rest, per layer
    assert got.step_s == pytest.approx(2 * (f + b) * (8 + 2 - 1))
    assert predict(half, cfg, fake_costs()).step_s == pytest.approx(2 * 1.5 * (8 + 2 - 1))  # linear without


def test_ep_keeps_a_share_of_the_experts_and_pays_its_all_to_alls(tmp_path):
    """dp=4 of a MoE model whose layer is 80% experts: ep=4 holds a quarter of them, their gradients are not summed
    over DP (each expert has one holder), and each MoE layer adds two all_to_alls in F and two in B."""
    moe = compose_run_config(["model=tiny-moe", "model.num_hidden_layers=4", "train.micro_batch_size=2"], tmp_path)
    costs = fake_costs(layer_expert_params=800)
    replicated = Candidate(4, 1, 1, 1, "1f1b", 4, 2, "none")
    split = dataclasses.replace(replicated, ep=4)
    assert split.overrides()[-1] == "parallel.ep=4" and "parallel.ep=1" not in replicated.overrides()
    one, four = predict(replicated, moe, costs), predict(split, moe, costs)
    assert one.peak_bytes == (4 * 1000 * 16 + 400,)  # 4 layers x (param, grad, 2 AdamW) + one live micro-batch
    assert four.peak_bytes == (4 * (200 + 800 // 4) * 16 + 400,)
    hop = 0.01  # one p2p message: (ep-1) of them per all_to_all, 2 per layer in F and 2 in B, 4 micro-batches
    assert predict(split, moe, fake_costs(layer_expert_params=800, p2p=Fit(hop, 0.0))).step_s == pytest.approx(
        four.step_s + 4 * 4 * 4 * 3 * hop)
    per_byte = Fit(0.0, 1e-6)  # gradients: all 16 KB over dp=4 replicated; 3.2 KB of dense ones at ep=4
    assert predict(replicated, moe, fake_costs(layer_expert_params=800, allreduce=per_byte)).step_s == pytest.approx(
        one.step_s + 16000 * 1e-6 * 1.5)
    assert predict(split, moe, fake_costs(layer_expert_params=800, allreduce=per_byte)).step_s == pytest.approx(
        four.step_s + 3200 * 1e-6 * 1.5)
    zero = compose_run_config(["model=tiny-moe", "model.num_hidden_layers=4", "train.micro_batch_size=2",
                               "parallel.zero=1"], tmp_path)  # dense AdamW state over dp=4, experts' over dp/ep=2
    assert predict(dataclasses.replace(split, ep=2, zero=1), zero, costs).peak_bytes == (
        4 * (200 * (8 + 8 / 4) + 400 * (8 + 8 / 2)) + 400,)


@pytest.mark.parametrize("zero,replicate,per_param", [
    (0, 1, 4 + 4 + 8),  # weight, gradient, AdamW's two moments (fp32), all whole
    (1, 1, 4 + 4 + 8 / 4),  # ZeRO-1: the moments over dp=4
    # FSDP at the step's fullest moment: zero=2 keeps the weights gathered beside their shard and the gradient whole
    # until the stage's reduce; zero=3 reduces and reshards every micro-batch (scripts/bench/fsdp.py counts the same)
    (2, 1, 4 + 4 / 4 + 4 + 8 / 4),
    (3, 1, (4 + 4 + 8) / 4),  # the ideal 1/dp share
    (3, 2, (4 + 4 + 8) / 2),  # HSDP: sharded within dp / dp_replicate = 2 ranks, replicated across
])
def test_each_zero_level_divides_what_it_shards(tmp_path, zero, replicate, per_param):
    """The memory model's bytes per parameter at each parallel.zero level, at the step's fullest moment."""
    cfg = compose_run_config(["model=tiny", "model.num_hidden_layers=4", "train.micro_batch_size=2",
                              f"parallel.zero={zero}", f"parallel.dp_replicate={replicate}"], tmp_path)
    dp4 = Candidate(4, 1, 1, 1, "1f1b", 4, 2, "none", zero=zero)
    assert predict(dp4, cfg, fake_costs()).peak_bytes == (4 * 1000 * per_param + 400,)
    assert candidate_of(cfg, dp=4) == dp4  # the level a config sets is the candidate's


@pytest.mark.parametrize("keys,device,host", [
    # bf16 gathers: the gathered copy at 2 bytes; the gradient accumulates in fp32 (FSDP's reduce dtype), shards fp32
    (["parallel.zero=2", "parallel.mixed_precision_param=bf16"], 2 + 4 + (4 + 8) / 4, 0),
    (["parallel.zero=3", "parallel.mixed_precision_param=bf16"], (4 + 4 + 8) / 4, 0),
    # offload: the shards, their gradients and AdamW's moments on the host; the gathered weights and gradients stay
    (["parallel.zero=2", "parallel.cpu_offload=true"], 4 + 4, (4 + 4 + 8) / 4),
    (["parallel.zero=3", "parallel.cpu_offload=true"], 0, (4 + 4 + 8) / 4),
    (["parallel.zero=2", "parallel.mixed_precision_param=bf16", "parallel.cpu_offload=true"], 2 + 4, (4 + 4 + 8) / 4),
])
def test_bf16_gathers_and_offloaded_shards_are_priced(tmp_path, keys, device, host):
    """What each FSDP option moves: bytes per parameter on the device (and in host memory) at the fullest moment."""
    cfg = compose_run_config(["model=tiny", "model.num_hidden_layers=4", "train.micro_batch_size=2", *keys], tmp_path)
    got = predict(Candidate(4, 1, 1, 1, "1f1b", 4, 2, "none", zero=int(keys[0][-1])), cfg, fake_costs())
    assert (got.peak_bytes, got.host_bytes) == ((4 * 1000 * device + 400,), (4 * 1000 * host,))


@pytest.mark.parametrize("zero,replicate,schedule,all_reduces", [
    (0, 1, "1f1b", 1),  # 16 KB of gradients: one all-reduce (a reduce-scatter and an all-gather)
    (1, 1, "1f1b", 1.5),  # then the stepped parameters gathered
    (2, 1, "1f1b", 1),  # the weights gathered once, the gradients reduce-scattered once
    (3, 1, "1f1b", 6),  # two gathers and a reduce-scatter for each of 4 micro-batches
    (3, 1, "zb-h1", 4.5),  # the I/W split reduces once a step
    (3, 2, "1f1b", 6 + 4 * 0.5),  # HSDP: then each of 4 shards (half the bytes) all-reduced across the 2 groups
])
def test_each_zero_level_pays_its_gathers_and_reduce_scatters(tmp_path, zero, replicate, schedule, all_reduces):
    """What a per-byte all-reduce cost adds to the step: each all-gather or reduce-scatter is half a ring all-reduce
    of the rank's bytes over its shard group (at dp=2, or dp=4 with dp_replicate=2: 16 KB x 1e-6 s for 4 layers)."""
    cfg = compose_run_config(["model=tiny", "model.num_hidden_layers=4", "train.micro_batch_size=2",
                              f"parallel.zero={zero}", f"parallel.dp_replicate={replicate}"], tmp_path)
    c = Candidate(2 * replicate, 1, 1 + (schedule == "zb-h1"), 1, schedule, 4, 2, "none", zero=zero)
    free = predict(c, cfg, fake_costs()).step_s
    paid = predict(c, cfg, fake_costs(allreduce=Fit(0.0, 1e-6))).step_s
    assert paid - free == pytest.approx(all_reduces * 16000 / c.pp * 1e-6)


def test_fsdp_gathers_and_reduces_layer_by_layer(cfg):
    """A call's latency: zero=0 all-reduces the 16 KB of gradients in one 25 MB bucket, zero=2 gathers and
    reduce-scatters each of the 4 layers (FSDP's unit) on its own."""
    dp2 = Candidate(2, 1, 1, 1, "1f1b", 4, 2, "none")
    paid = {z: predict(dataclasses.replace(dp2, zero=z), cfg, fake_costs(allreduce=Fit(0.01, 0.0))).step_s
            - predict(dataclasses.replace(dp2, zero=z), cfg, fake_costs()).step_s for z in (0, 2)}
    assert paid == pytest.approx({0: 0.01, 2: 4 * (0.01 + 0.01) / 2})
