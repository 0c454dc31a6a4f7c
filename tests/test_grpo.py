"""train.task=grpo: MiniMind's GRPO / CISPO against a plain PyTorch loop of its formulas, the rule rewards, group
advantages, the rollout rows, the reference pass and the one-line refusals of bad GRPO input.

The plain loop is MiniMind's train_grpo.py restated: left-padded prompts and completions through the model with the
padding mask, per-token log-probabilities gathered at the completion's positions, the reference model's likewise,
(r - mean) / (std + 1e-4) per group, the clipped ratio or CISPO with the k3 KL, a mean per completion then over the
batch, plus the aux loss. Sluice's side is its own path: the rows rolled to the left, the starting weights swapped in
for the reference pass, the engine's step with GroupPolicyLoss. The MoE aux loss routes every position, padding
included (as MiniMind's does); a padding position's hidden state depends on where the padding sits (MiniMind: left,
masked; Sluice: after the completion, unmasked), so the plain loop takes the aux loss of the rows as the step feeds
them, and its policy loss from MiniMind's own path.
"""

import copy
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from minimind import MiniMindConfig, MiniMindForCausalLM
from models import decoder_of
from parallel.step import LocalEngine, MicroBatch
from training.methods.grpo.reference import StartingWeights
from training.methods.grpo.rewards import RewardError, minimind_rules, rule_reward, score
from training.methods.grpo.rollouts import group_advantages, training_rows, write_samples
from training.methods.grpo.objective import (ADVANTAGES, FLAT, OLD_LOGPS, REF_LOGPS, REWARDS, START, GroupPolicyLoss)

CPU = torch.device("cpu")
PAD, EOS, VOCAB = 0, 2, 96
GROUP, PROMPT, NEW = 3, 6, 5


# --- MiniMind's formulas, plainly ------------------------------------------------------------------------------------


def plain_rule_reward(response: str) -> float:
    """calculate_rewards of train_grpo.py for one response, without the reward model."""
    def rep_penalty(text, n=3, cap=0.5):
        toks = re.findall(r"\w+|[^\w\s]", text.lower())
        grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
        return min(cap, (len(grams) - len(set(grams))) * cap * 2 / len(grams)) if grams else 0.0

    reward, answer = (0.5 if 20 <= len(response.strip()) <= 800 else -0.5), response
    if "</think>" in response:
        thinking, rest = response.split("</think>", 1)
        reward += 1.0 if 20 <= len(thinking.strip()) <= 300 else -0.5
        reward += 0.25 if response.count("</think>") == 1 else -0.25
        answer = rest.strip()
    return reward - rep_penalty(answer)


def plain_loss(model, reference, outputs, completion_mask, old, rewards, loss_type, beta=0.1, eps=0.2, high=5.0):
    """One micro-batch of train_grpo.py: (policy loss, advantages)."""
    full_mask = (outputs != PAD).long()
    logp_pos = PROMPT - 1 + torch.arange(NEW).unsqueeze(0)
    res = model(outputs, attention_mask=full_mask)
    per_token = F.log_softmax(res.logits[:, :-1, :], dim=-1).gather(2, outputs[:, 1:].unsqueeze(-1)).squeeze(-1)
    per_token = per_token.gather(1, logp_pos.expand(len(outputs), -1))
    with torch.no_grad():
        ref = F.log_softmax(reference(outputs, attention_mask=full_mask).logits[:, :-1, :], dim=-1)
        ref = ref.gather(2, outputs[:, 1:].unsqueeze(-1)).squeeze(-1).gather(1, logp_pos.expand(len(outputs), -1))
    grouped = rewards.view(-1, GROUP)
    mean = grouped.mean(dim=1).repeat_interleave(GROUP)
    std = grouped.std(dim=1, unbiased=False).repeat_interleave(GROUP)
    advantages = (rewards - mean) / (std + 1e-4)
    kl = ref - per_token
    per_token_kl = torch.exp(kl) - kl - 1
    ratio = torch.exp(per_token - old)
    if loss_type == "cispo":
        per_token_loss = -(torch.clamp(ratio, max=high).detach() * advantages.unsqueeze(1) * per_token
                           - beta * per_token_kl)
    else:
        clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
        per_token_loss = -(torch.min(ratio * advantages.unsqueeze(1), clipped * advantages.unsqueeze(1))
                           - beta * per_token_kl)
    mask = completion_mask.int()
    policy = ((per_token_loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    return policy, advantages


# --- a fixed rollout -------------------------------------------------------------------------------------------------


def tiny_model(moe: bool, seed: int) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(MiniMindConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, use_moe=moe,
                                              num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01,
                                              max_position_embeddings=64))


def fixed_rollout(prompts: int = 4, seed: int = 3):
    """(outputs [B, P + N] left-padded prompts then completions, pad after EOS; prompt mask; completion mask)."""
    gen = torch.Generator().manual_seed(seed)
    rows = prompts * GROUP
    outputs = torch.randint(3, VOCAB, (rows, PROMPT + NEW), generator=gen)
    lengths = torch.randint(2, PROMPT + 1, (prompts,), generator=gen).repeat_interleave(GROUP)
    prompt_mask = torch.arange(PROMPT)[None] >= PROMPT - lengths[:, None]
    outputs[:, :PROMPT][~prompt_mask] = PAD
    stops = torch.randint(0, NEW + 2, (rows,), generator=gen)  # past NEW: no EOS in the completion
    completion_mask = torch.arange(NEW)[None] <= stops[:, None]
    for row, stop in enumerate(stops.tolist()):
        if stop < NEW:
            outputs[row, PROMPT + stop] = EOS
            outputs[row, PROMPT + stop + 1:] = PAD
    return outputs, prompt_mask, completion_mask


@pytest.mark.parametrize("loss_type,moe", [("cispo", False), ("grpo", False), ("grpo", True)])
def test_the_loss_and_gradients_equal_a_plain_loop_of_minimind_formulas(loss_type, moe):
    """Two micro-batches of two groups each, old log-probabilities off the policy's (so the ratio clips), a reference
    other than the policy (so the KL is not 0), one group of equal rewards: the step's loss and every gradient equal
    the plain loop's accumulated over the same micro-batches."""
    reference, policy = tiny_model(moe, 0), tiny_model(moe, 1)
    reference.eval()
    outputs, prompt_mask, completion_mask = fixed_rollout()
    rows = len(outputs)
    gen = torch.Generator().manual_seed(5)
    rewards = torch.tensor([0.5, -0.5, 1.25, 0.3, 0.3, 0.3, -1.0, 0.0, 2.0, 0.75, 0.1, -0.2])  # group 2: flat
    with torch.no_grad():
        full_mask = (outputs != PAD).long()
        logp = F.log_softmax(policy(outputs, attention_mask=full_mask).logits[:, :-1], -1)
        logp = logp.gather(2, outputs[:, 1:, None])[..., 0][:, PROMPT - 1:]
    old = (logp + 0.4 * torch.randn(rows, NEW, generator=gen)) * completion_mask

    # Sluice: the engine holds the reference weights when StartingWeights copies them, then the policy's.
    engine = LocalEngine(decoder_of(copy.deepcopy(reference).train()), CPU, torch.float32,
                         GroupPolicyLoss(loss_type, 0.1, 0.2, 5.0, GROUP))
    starting = StartingWeights(engine)
    engine.model.load_state_dict(policy.state_dict())
    ids, labels, starts = training_rows(outputs, prompt_mask, completion_mask, NEW, PAD)
    half = rows // 2
    micro_batches = [MicroBatch(ids[i:i + half], labels[i:i + half], rows, {START: starts[i:i + half]})
                     for i in (0, half)]
    ref_logps = starting.token_logps(micro_batches, NEW)
    advantages, flat = group_advantages(rewards, GROUP)
    for i, mb in zip((0, half), micro_batches):
        part = slice(i, i + half)
        mb.extra.update({ADVANTAGES: advantages[part], OLD_LOGPS: old[part], REF_LOGPS: ref_logps[part],
                         REWARDS: rewards[part], FLAT: flat[part]})
    result = engine.step(micro_batches)

    plain_total = 0.0
    for i in (0, half):
        part = slice(i, i + half)
        loss, plain_adv = plain_loss(policy, reference, outputs[part], completion_mask[part], old[part],
                                     rewards[part], loss_type)
        aux = policy(ids[part]).aux_loss
        ((loss + aux) / 2).backward()
        plain_total += float(loss.detach()) / 2
        torch.testing.assert_close(advantages[part], plain_adv)
    assert math.isclose(result.loss, plain_total, rel_tol=1e-5), (result.loss, plain_total)
    for name, param in engine.model.named_parameters():
        expected = dict(policy.named_parameters())[name].grad
        torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-6, msg=name)
    assert result.metrics["flat_groups"] == 1
    assert result.metrics["kl_ref"] != 0 and 0 < result.metrics["clip_fraction"] < 1 or loss_type == "cispo"
    assert math.isclose(result.metrics["reward_mean"], float(rewards.mean()), rel_tol=1e-6)
    assert math.isclose(result.metrics["completion_len"], float(completion_mask.sum()) / rows, rel_tol=1e-9)
    # the swap put the policy's weights back, bit for bit
    policy_state = policy.state_dict()
    assert all(torch.equal(t, policy_state[k]) for k, t in engine.model.state_dict().items())


def test_group_advantages_of_equal_rewards_are_zero_not_nan():
    advantages, flat = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0]), 3)
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0] and flat.tolist() == [True] * 3 + [False] * 3
    assert torch.isfinite(advantages).all() and advantages[3] < 0 < advantages[5]


@pytest.mark.parametrize("text", [
    "short", "a reply of well over twenty characters.", "  padded  ", "x" * 801,
    "thinking about it carefully here </think> the answer is four.", "tiny</think>ok", "a</think>b</think>c d e f g h",
    "the cat sat. the cat sat. the cat sat. the cat sat.",
    "<think>\nlet me think about the sum\n</think>\n\n3 plus 4 is 7.",
])
def test_rule_rewards_equal_minimind(text):
    assert rule_reward(text) == pytest.approx(plain_rule_reward(text), abs=1e-12)
    assert minimind_rules(["p"], [text]) == [rule_reward(text)]


def test_a_reward_that_raises_or_returns_the_wrong_shape_is_named_with_the_step():
    def broken(prompts, completions):
        raise KeyError("judge")

    with pytest.raises(RewardError, match=r"grpo.rewards: judge.fn raised KeyError at step 7"):
        score({"judge.fn": broken}, ["p", "p"], ["a", "b"], 7)
    with pytest.raises(RewardError, match=r"returned 1 values at step 3 for 2 completions"):
        score({"short": lambda p, c: [1.0]}, ["p", "p"], ["a", "b"], 3)
    with pytest.raises(RewardError, match=r"non-finite value at step 2"):
        score({"nan": lambda p, c: [float("nan")] * 2}, ["p", "p"], ["a", "b"], 2)
    assert score({"a": lambda p, c: [1, 2], "b": lambda p, c: [0.5, 0.5]}, ["p", "q"], ["x", "y"], 1) == [1.5, 2.5]


def test_training_rows_put_the_real_tokens_first_and_label_the_completion():
    outputs, prompt_mask, completion_mask = fixed_rollout(prompts=2)
    ids, labels, starts = training_rows(outputs[:, :PROMPT + 3], prompt_mask, completion_mask[:, :3], NEW, PAD)
    assert ids.shape == (6, PROMPT + NEW)
    for row in range(6):
        real = outputs[row, :PROMPT][prompt_mask[row]]
        length = len(real)
        assert starts[row] == length - 1
        assert torch.equal(ids[row, :length], real)
        assert torch.equal(ids[row, length:length + 3], outputs[row, PROMPT:PROMPT + 3])
        kept = completion_mask[row, :3]
        assert torch.equal(labels[row, length:length + 3][kept], outputs[row, PROMPT:PROMPT + 3][kept])
        assert (labels[row, :length] == -100).all() and (labels[row, length + 3:] == -100).all()


def test_rollouts_jsonl_is_rewritten_in_place_and_refuses_a_link(tmp_path):
    write_samples(tmp_path, 2, [{"step": 2, "completion": "a"}])
    write_samples(tmp_path, 4, [{"step": 4, "completion": "b"}])
    write_samples(tmp_path, 4, [{"step": 4, "completion": "c"}])  # a resumed run redoes step 4
    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [line["completion"] for line in lines] == ["a", "c"]
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "target").write_text("keep")
    (tmp_path / "rollouts.jsonl").unlink()
    (tmp_path / "rollouts.jsonl").symlink_to(other / "target")
    with pytest.raises(OSError, match="not a regular file"):
        write_samples(tmp_path, 6, [{"step": 6}])
    assert (other / "target").read_text() == "keep"


# --- layouts: dp2, pp2, tp2 x pp2 and ep2 equal one process ----------------------------------------------------------

def letters(prompts, completions, scale=1.0):
    """A reward by `_target_` with a keyword bound in the config: the completion's distinct letters (a spread in
    every group, unlike the rule rewards on a fresh model's long completions)."""
    return [scale * len({ch for ch in c if ch.isalpha()}) for c in completions]


LETTERS = "{_target_:tests.test_grpo.letters,scale:0.1}"
LAYOUT_RUN = ["train.task=grpo", "train.steps=2", f"grpo.rewards=[minimind_rules,{LETTERS}]", "train.seq_len=32",
              "grpo.max_new_tokens=8", "grpo.num_generations=2",
              "train.micro_batch_size=4", "schedule.n_microbatches=2", "grpo.sample_every=1",
              "grpo.beta=0.5", "data.num_docs=300", "optim.lr=3e-3"]
DENSE, MOE = ["model=tiny"], ["model=tiny-moe", "model.num_experts_per_tok=2"]


def layout_cases():
    from tests.equivalence import EMU, Layout

    return [Layout("dp2", [*DENSE], ["parallel.dp=2"], 2, 2),
            Layout("tp2-pp2-emu", [*DENSE], ["parallel.tp=2", "parallel.pp=2", EMU], 2, 1),
            Layout("ep2-moe", [*MOE], ["parallel.dp=2", "parallel.ep=2"], 2, 2),
            Layout("dp2-zero3", [*DENSE], ["parallel.dp=2", "parallel.zero=3"], 2, 2),  # rollouts through the shards
            Layout("pp2-emu", [*DENSE], ["parallel.pp=2", EMU], 1, 1)]


def sampled(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


def grpo_metrics(run_dir) -> list[dict]:
    keys = ("reward_mean", "reward_std", "completion_len", "kl_ref", "clip_fraction", "advantage_std")
    return [{k: r[k] for k in keys} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """Every layout's results and run directory, and its one-process baseline's (the world-2 layouts share one
    spawn; pp2 emulated runs here)."""
    from tests.equivalence import baseline, layouts_worker
    from tests.shared import once_per_session
    from tests.spawn import run_workers

    cases = layout_cases()

    def compute(root):
        cache = str(root / "cache")
        spawned = [c for c in cases if c.world == 2]
        runs = [([*LAYOUT_RUN, *c.run, *c.layout], str(root / c.name)) for c in spawned]
        by_rank = run_workers(layouts_worker, 2, runs, cache, timeout=600)
        out = {c.name: [r[i] for r in by_rank] for i, c in enumerate(spawned)}
        for c in cases:
            if c.world == 1:
                out[c.name] = layouts_worker(0, 1, [([*LAYOUT_RUN, *c.run, *c.layout], str(root / c.name))], cache)
        for c in cases:
            key = f"baseline-{'-'.join(c.run)}-dp{c.dp}"
            if key not in out:
                out[key] = [baseline([*LAYOUT_RUN, *c.run], root / "cache", root / key, c.dp)]
        return {"root": root, **out}

    return once_per_session(tmp_path_factory, "grpo-layouts", compute)


@pytest.mark.parametrize("name", ["dp2", "tp2-pp2-emu", "ep2-moe", "dp2-zero3", "pp2-emu"])
def test_a_layout_samples_and_trains_as_one_process(layout_runs, name):
    """The same completions (replica 0's sampled groups, the global batch's reward and length statistics), the same
    losses, gradients and parameters as one process over the same global batch."""
    from tests.equivalence import Tolerances, assert_equivalent

    case = next(c for c in layout_cases() if c.name == name)
    key = f"baseline-{'-'.join(case.run)}-dp{case.dp}"
    root = layout_runs["root"]
    # The loss is group-centred (a group's advantages sum to 0), so it is ~1e-3 of its terms (|A log p| ~ 8): an
    # fp32 summation-order difference of 3e-8 is 5e-5 of the loss and 4e-9 of its terms. So the loss is held to
    # 1e-5 of its terms' size (the logged loss_magnitude, the mean |loss| of a completion), the aux loss and the
    # gradients to the harness's 1e-5 of their own, parameters as DPO's at its lr.
    layout, reference = layout_runs[name], layout_runs[key][0]
    assert_equivalent(layout, reference, Tolerances(loss=float("inf"), param=3e-4))
    scale = [m["loss_magnitude"] for m in map(json.loads, (root / key / "metrics.jsonl").read_text().splitlines())]
    for got in [r["losses"] for r in layout] + [[m["loss"] for m in layout[0]["metrics"]]]:
        off = [abs(g - w) / s for g, w, s in zip(got, reference["losses"], scale)]
        assert len(got) == len(scale) and max(off) <= 1e-5, off
    aux = [(m.get("aux_loss", 0.0), w.get("aux_loss", 0.0)) for m, w in zip(layout[0]["metrics"], reference["metrics"])]
    assert all(g == pytest.approx(w, rel=1e-5, abs=0) for g, w in aux), aux
    want, got = sampled(root / key), sampled(root / name)
    assert [(s["prompt"], s["completion"]) for s in got] == [(s["prompt"], s["completion"]) for s in want[:len(got)]]
    for mine, theirs in zip(grpo_metrics(root / name), grpo_metrics(root / key)):
        for k, v in theirs.items():
            assert mine[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (k, mine, theirs)


def test_a_resumed_run_samples_and_trains_as_the_uninterrupted_one(tmp_path):
    """The sampling seed is a function of train.seed and the step, the reference the starting weights (kept before
    the resume loads a checkpoint): a run resumed after step 2 continues bit for bit, its step-3 completions too."""
    from parallel.grid import ParallelGrid
    from tests.equivalence import assert_bitwise_resume, compose_run_config, run_training

    def run(name: str, *extra: str) -> dict:
        cfg = compose_run_config([*LAYOUT_RUN, *DENSE, "train.steps=3", "checkpoint.every=2", *extra], tmp_path / "c")
        return run_training(cfg, ParallelGrid.single(CPU), tmp_path / name)

    straight = run("straight")
    resumed = run("resumed", f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step_00000002'}")
    assert_bitwise_resume([straight], [resumed], start=2)
    assert [s for s in sampled(tmp_path / "straight") if s["step"] == 3] == sampled(tmp_path / "resumed")
