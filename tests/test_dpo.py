"""train.task=dpo: the DPO loss over chosen/rejected pairs, its reference log-probabilities from the starting weights.

Sluice's one process against a plain PyTorch loop written here (a frozen reference model run every step, the loss
`-logsigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))` plus the MoE aux loss, AdamW); pipeline, TP and DP layouts
against one process (the equivalence harness; the world-2 layouts share one spawn), the held-out pairs' metrics
among them; the pair layout of the data and the one-line errors of bad pairs and configs.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from minimind import MiniMindConfig, MiniMindForCausalLM
from tests.equivalence import (EMU, Layout, Tolerances, assert_equivalent, assert_params_match_plain_loop, baseline,
                               compose_run_config, layouts_worker)
from tests.shared import once_per_session, session_dir
from tests.spawn import run_workers
from tests.test_reference_loop import reference_lr

pytestmark = pytest.mark.timeout(900)

BETA = 0.5  # not the default: a beta that is not applied (or applied twice) changes every number below
DPO = ["train.task=dpo", "data.format=chat", "train.seq_len=64", f"dpo.beta={BETA}", "train.steps=3",
       "train.micro_batch_size=4", "schedule.n_microbatches=4", "train.grad_clip=1.0", "optim.weight_decay=0.5",
       "optim.warmup_steps=2", "optim.lr=3e-3"]
DENSE, MOE = ["model=tiny"], ["model=tiny-moe", "model.num_experts_per_tok=2"]
VALIDATION = ["data.val_fraction=0.15", "train.eval_every=2", "train.eval_batches=2"]
INTERLEAVED = ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=interleaved-1f1b", EMU]
ZBV = ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=zbv", EMU]
LAYOUTS = [Layout(f"{name}-{kind}", [*model, *extra], layout, 2, dp)
           for kind, model in (("dense", DENSE), ("moe", MOE))
           for name, layout, dp, extra in (("pp2-1f1b", ["parallel.pp=2", "schedule=1f1b"], 1, []),
                                           ("tp2-pp2-interleaved-emu", INTERLEAVED, 1, []),
                                           ("dp2-zbv-emu", ZBV, 2, VALIDATION),
                                           ("dp2-zero3", ["parallel.dp=2", "parallel.zero=3"], 2, []))]
# A parameter's difference between layouts is AdamW's update difference (each entry's at most lr), so it grows with
# lr: this lr is 6x the default (3e-3 against 5e-4); the tolerance 3x the default 1e-4. (tp2 x pp2 MoE: layer 2's k_proj
# ends 1.24e-4 off on an AMD EPYC and within 1e-4 on CI's CPU: the matmul kernels' summation order differs by CPU.)
DPO_TOL = Tolerances(param=3e-4)
REWARDS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return {"root": tmp_path_factory.mktemp("dpo"), "weights": {}, "baselines": {}, "results": {},
            "factory": tmp_path_factory}


def minimind_of(cfg) -> MiniMindForCausalLM:
    """A MiniMind model of the run config's model section (fresh weights)."""
    fields = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if v is not None and k not in ("name",
                                                                                                      "hf_config")}
    return MiniMindForCausalLM(MiniMindConfig(**fields))


def initial_weights(workspace, model: list[str]) -> str:
    """A MiniMind .pth with fresh weights of the model: the starting weights and the frozen reference of every run."""
    key = tuple(model)
    if key not in workspace["weights"]:
        torch.manual_seed(11)
        path = workspace["root"] / f"init-{len(workspace['weights'])}.pth"
        torch.save(minimind_of(compose_run_config([*DPO, *model], workspace["root"] / "cache")).state_dict(), path)
        workspace["weights"][key] = str(path)
    return workspace["weights"][key]


def run_args(workspace, run: list[str]) -> list[str]:
    model = [a for a in run if a.startswith("model")]
    return [*DPO, *run, f"checkpoint.load_dense={initial_weights(workspace, model)}"]


def single_process(workspace, run: list[str], dp: int = 1) -> tuple[dict, Path]:
    """One process over the global batch of `dp` replicas: its results and its run directory (memoised)."""
    key = (tuple(run), dp)
    if key not in workspace["baselines"]:
        run_dir = workspace["root"] / f"baseline-{len(workspace['baselines'])}"
        result = baseline(run_args(workspace, run), workspace["root"] / "cache", run_dir, dp)
        workspace["baselines"][key] = result, run_dir
    return workspace["baselines"][key]


def logged(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- an independent reference: the plain PyTorch loop ---------------------------------------------------------------


def label_logps(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its (shifted, unmasked) labels, and the model's aux loss."""
    out = model(input_ids=ids)
    logp = F.log_softmax(out.logits[:, :-1].float(), dim=-1)
    targets = labels[:, 1:]
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != -100)).sum(dim=1), out.aux_loss


def plain_dpo(model: torch.nn.Module, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], cfg) -> dict:
    """DPO in plain PyTorch: a frozen copy of the starting model as the reference, run on every micro-batch; rows 2i
    chosen and 2i+1 rejected; the loss summed over a step's pairs and divided by their number, the aux loss averaged
    over its micro-batches; clipping, AdamW with decay on the linear and embedding weights, warm-up then cosine."""
    o = cfg.optim
    reference = MiniMindForCausalLM(model.config)
    reference.load_state_dict(model.state_dict())
    reference.eval().requires_grad_(False)
    decay = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    groups = [{"params": [p for p in model.parameters() if id(p) in decay], "weight_decay": o.weight_decay},
              {"params": [p for p in model.parameters() if id(p) not in decay], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    losses, norms, rewards = [], [], []
    for step, micro_batches in enumerate(steps):
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(step, len(steps), o.lr, o.warmup_steps, o.min_lr_ratio)
        pairs = sum(len(ids) // 2 for ids, _ in micro_batches)
        loss_sum, chosen_sum, rejected_sum, right = 0.0, 0.0, 0.0, 0
        for ids, labels in micro_batches:
            with torch.no_grad():
                ref, _ = label_logps(reference, ids, labels)
            policy, aux = label_logps(model, ids, labels)
            chosen, rejected = BETA * (policy[0::2] - ref[0::2]), BETA * (policy[1::2] - ref[1::2])
            loss = -F.logsigmoid(chosen - rejected).sum()
            (loss / pairs + aux / len(micro_batches)).backward()
            loss_sum += loss.item()
            chosen_sum, rejected_sum = chosen_sum + chosen.sum().item(), rejected_sum + rejected.sum().item()
            right += int((chosen > rejected).sum())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss_sum / pairs)
        rewards.append({"reward_chosen": chosen_sum / pairs, "reward_rejected": rejected_sum / pairs,
                        "reward_margin": (chosen_sum - rejected_sum) / pairs, "reward_accuracy": right / pairs})
    return {"losses": losses, "grad_norms": norms, "rewards": rewards,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_one_process_equals_a_plain_pytorch_dpo_loop(workspace, model):
    from training.data import build_data

    result, run_dir = single_process(workspace, model)
    cfg = compose_run_config(run_args(workspace, model), workspace["root"] / "cache")
    stream = build_data(cfg, 0, 1, verbose=False)[0]
    steps = [[(mb.input_ids, mb.labels) for mb in stream.batch(step)] for step in range(cfg.train.steps)]
    net = minimind_of(cfg)
    net.load_state_dict(torch.load(cfg.checkpoint.load_dense, weights_only=True))
    want = plain_dpo(net.train(), steps, cfg)

    assert result["losses"][0] == pytest.approx(0.6931471805599453, rel=1e-7)  # the policy is the reference at step 1
    assert result["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert [m["grad_norm"] for m in result["metrics"]] == pytest.approx(want["grad_norms"], rel=1e-4)
    records = logged(run_dir)
    for record, rewards in zip(records, want["rewards"]):
        assert record["pairs"] == 8 and record["reward_accuracy"] == rewards["reward_accuracy"]
        assert [record[k] for k in REWARDS[:3]] == pytest.approx([rewards[k] for k in REWARDS[:3]], rel=1e-4, abs=1e-7)
    assert records[-1]["reward_margin"] > 0  # DPO moved the policy towards the chosen answers
    assert_params_match_plain_loop(result, want["params"])


# --- layouts against one process -------------------------------------------------------------------------------------


def layout_results(workspace, case: Layout) -> list[dict]:
    """Every rank's results; the layouts (all of world size 2) train in one spawn."""
    if not workspace["results"]:
        def compute(root: Path) -> dict[str, list[dict]]:
            runs = [([*run_args(workspace, c.run), *c.layout], str(root / c.name)) for c in LAYOUTS]
            by_rank = run_workers(layouts_worker, 2, runs, str(workspace["root"] / "cache"), timeout=600)
            return {c.name: [r[i] for r in by_rank] for i, c in enumerate(LAYOUTS)}

        workspace["results"].update(once_per_session(workspace["factory"], "dpo-layouts-world2", compute))
    return workspace["results"][case.name]


@pytest.mark.parametrize("case", LAYOUTS, ids=[case.name for case in LAYOUTS])
def test_layout_equals_single_process(workspace, case):
    reference, _ = single_process(workspace, case.run, case.dp)
    results = layout_results(workspace, case)
    assert_equivalent(results, reference, DPO_TOL)  # losses, aux losses, grad norms, val_loss, data, grads, parameters
    if VALIDATION[0] in case.run:
        assert {m["step"] for m in results[0]["metrics"] if "val_loss" in m} == {2, 3}


def test_rewards_and_held_out_metrics_equal_single_process(workspace):
    """The logged rewards of a dp2 ZB-V run with validation, and its held-out pairs' loss, margin and accuracy."""
    case = next(c for c in LAYOUTS if c.name == "dp2-zbv-emu-moe")
    reference, run_dir = single_process(workspace, case.run, case.dp)
    layout_results(workspace, case)
    want = logged(run_dir)
    got = logged(session_dir(workspace["factory"], "dpo-layouts-world2") / case.name)
    names = [*REWARDS, "val_loss", *(f"val_{k}" for k in REWARDS)]
    assert [sorted(set(names) & set(r)) for r in want] == [sorted(REWARDS), sorted(names), sorted(names)]
    for g, w in zip(got, want, strict=True):
        keys = [k for k in names if k in w]
        assert [g[k] for k in keys] == pytest.approx([w[k] for k in keys], rel=1e-4, abs=1e-7), g["step"]
    assert "val_ppl" not in want[-1] and 0.0 <= want[-1]["val_reward_accuracy"] <= 1.0
    assert reference["losses"] == pytest.approx([r["loss"] for r in want])


# --- data and configuration ------------------------------------------------------------------------------------------


def test_a_micro_batch_holds_whole_pairs_with_their_reference(workspace):
    """Rows 2i and 2i+1 answer the same prompt (equal up to the first assistant token, different labels), and
    the reference log-probabilities of the pairs are the starting weights' (step 1's loss is log 2 exactly above)."""
    from training.data import build_data

    cfg = compose_run_config(run_args(workspace, DENSE), workspace["root"] / "cache")
    stream = build_data(cfg, 0, 1, verbose=False)[0]
    for mb in stream.batch(0):
        assert mb.input_ids.shape[0] == cfg.train.micro_batch_size and mb.global_tokens == 8 and mb.extra == {}
        for chosen, rejected, c_labels, r_labels in zip(mb.input_ids[0::2], mb.input_ids[1::2], mb.labels[0::2],
                                                        mb.labels[1::2]):
            first = int((c_labels != -100).nonzero()[0])
            assert first == int((r_labels != -100).nonzero()[0]) and torch.equal(chosen[:first], rejected[:first])
            assert not torch.equal(c_labels, r_labels)


def test_bad_pairs_and_configs_are_one_line(tmp_path):
    from training.config import ConfigError
    from training.config.validate import validate
    from training.data import DataError, build_data

    good = {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello."}],
            "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away."}]}
    bad = {"chosen": good["chosen"], "rejected": [{"role": "robot", "content": "hi"}]}
    path = tmp_path / "dpo.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good] * 20 + [bad, {"chosen": good["chosen"]}]) + "\n")
    args = ["train.task=dpo", "data=jsonl", f"data.path={path}", "data.tokenizer=synthetic", "data.format=chat",
            "train.seq_len=64", "model=tiny"]
    cfg = compose_run_config(args, tmp_path / "cache")
    with pytest.raises(DataError, match=rf"^data.path: {path}:21: \"rejected\": message 0 has role 'robot'; use one "
                                        r"of system, user, assistant; fix or remove the line"):
        build_data(cfg, 0, 1, verbose=False)
    skipping = compose_run_config([*args, "data.skip_bad_lines=true"], tmp_path / "cache")
    assert len(build_data(skipping, 0, 1, verbose=False)[0].samples) == 20  # the pair without "rejected" too
    for changes, message in (
            (["train.micro_batch_size=3"], r"^train.micro_batch_size=3 is odd, and under train.task=dpo a micro-batch "
                                           r"holds whole chosen/rejected pairs"),
            (["data.format=padded"], r"^train.task=dpo reads chosen/rejected conversations, each padded to one "
                                     r"sample; set data.format=chat \(here data.format=padded\)"),
            (["dpo.beta=0"], r"^dpo.beta")):
        with pytest.raises(ConfigError, match=message):
            validate(compose_run_config([*args, "data.skip_bad_lines=true", *changes], tmp_path / "cache"))
    sft = compose_run_config(["train.task=sft", "model=tiny", "data.format=packed"], tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"^train.task=sft trains on conversations; set data.format=chat"):
        validate(sft)
    assert any("dpo.beta=0.5 is read only when train.task=dpo" in w
               for w in validate(compose_run_config(["model=tiny", "dpo.beta=0.5"], tmp_path / "cache")))
