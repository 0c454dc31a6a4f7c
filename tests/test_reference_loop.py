"""An independent reference: the steps Sluice trains, trained again by a plain PyTorch loop written here.

The loop uses no Sluice code but the model class: its own forward, the next-token loss summed and divided by the
global batch's label count, the MoE aux loss averaged over the step's micro-batches, backward per micro-batch,
`torch.nn.utils.clip_grad_norm_`, torch's AdamW with weight decay on the weight matrices of linear and embedding
modules only, and the documented schedule (linear warm-up, then cosine to `min_lr_ratio * lr`) written out
below. Sluice's one process and a dp2 layout must match it in loss, grad norm and final parameters, so a bug the
engines share (loss normalisation, clipping, decay groups, the LR schedule) cannot cancel out.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from minimind import MiniMindConfig, MiniMindForCausalLM
from tests.equivalence import compose_run_config, layouts_worker, run_training
from tests.spawn import run_workers
from tests.test_data_chat import CONVERSATIONS, chat_file

# The module's shared runs are set up inside its first test: under load that can take minutes, so the
# per-test bound is the whole module's, not pytest.ini's 600 s for one test.
pytestmark = pytest.mark.timeout(1800)

STEPS = 3
# Clipping active (grad norms are ~2 at this size), decay strong enough to move a norm weight visibly if it hit one,
# and a two-step warm-up whose off-by-one would change the first step's learning rate.
COMMON = [f"train.steps={STEPS}", "schedule.n_microbatches=4", "train.grad_clip=1.0", "optim.weight_decay=0.5",
          "optim.warmup_steps=2", "optim.min_lr_ratio=0.1", "checkpoint.save_final=false"]
PADDED = ["model=tiny", "data.format=padded", "train.seq_len=128"]  # one document per sample: counts differ
CASES = {"dense": ["model=tiny"], "moe": ["model=tiny-moe", "model.num_experts_per_tok=2"], "padded": PADDED,
         "chat": ["model=tiny", "data=jsonl", "data.format=chat", "train.seq_len=64", "{chat}"]}
DP2 = {"padded-dp2": PADDED, "moe-dp2": ["model=tiny-moe", "model.num_experts_per_tok=2"],
       "padded-dp2-zero3": [*PADDED, "parallel.zero=3"]}  # FSDP's shards: the same numbers as whole parameters


def reference_lr(step: int, total: int, lr: float, warmup: int, min_ratio: float) -> float:
    """The documented schedule: step k (from 0) of a warm-up of W steps uses lr * (k + 1) / W, then a cosine from lr
    to min_ratio * lr that reaches its floor at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup - 1, 1), 1.0)
    floor = lr * min_ratio
    return floor + (lr - floor) * (1 + math.cos(math.pi * progress)) / 2


def reference_train(model: torch.nn.Module, steps: list[list], cfg) -> dict:
    """Train `model` on `steps` (each a list of (input_ids, labels)) with plain PyTorch; losses, norms, params."""
    o = cfg.optim
    matrices = [m.weight for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    decay_ids = {id(p) for p in matrices}
    groups = [{"params": [p for p in model.parameters() if id(p) in decay_ids], "weight_decay": o.weight_decay},
              {"params": [p for p in model.parameters() if id(p) not in decay_ids], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    losses, norms = [], []
    for step, micro_batches in enumerate(steps):
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(step, len(steps), o.lr, o.warmup_steps, o.min_lr_ratio)
        tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro_batches)
        loss_sum = 0.0
        for ids, labels in micro_batches:
            out = model(input_ids=ids)
            ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100,
                                 reduction="sum")
            (ce / tokens + out.aux_loss / len(micro_batches)).backward()
            loss_sum += ce.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss_sum / tokens)
    return {"losses": losses, "grad_norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    tokenizer = root / "tokenizer"
    from tests.data_helpers import SMALL, spec
    from training.data import build_tokenizer

    build_tokenizer(spec(**SMALL, cache_dir=str(root / "tok-cache"))).save_pretrained(tokenizer)
    chat = chat_file(root / "chat.jsonl", CONVERSATIONS, repeat=40)
    return {"root": root, "chat": [f"data.path={chat}", f"data.tokenizer={tokenizer}"], "dp2": {}}


def overrides(workspace, case: list[str], weights: Path) -> list[str]:
    args = [a for arg in case for a in (workspace["chat"] if arg == "{chat}" else [arg])]
    return [*COMMON, *args, f"checkpoint.load_dense={weights}"]


def initial_weights(workspace, case: list[str]) -> tuple[Path, MiniMindConfig]:
    """A dense .pth of the case's model with fresh weights (both loops start from it) and its config."""
    cfg = compose_run_config([*COMMON, *[a for a in case if a != "{chat}"]], workspace["root"] / "cache")
    fields = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if v is not None and k not in ("name",
                                                                                                      "hf_config")}
    config = MiniMindConfig(**fields)
    path = workspace["root"] / f"init-{abs(hash(tuple(case)))}.pth"
    if not path.exists():
        torch.manual_seed(5)
        torch.save(MiniMindForCausalLM(config).state_dict(), path)
    return path, config


def reference_of(workspace, case: list[str], dp: int) -> dict:
    """The plain loop over the global batches Sluice's data layer hands a dp-replica run, from the same weights."""
    from training.data import build_data

    path, config = initial_weights(workspace, case)
    cfg = compose_run_config(overrides(workspace, case, path), workspace["root"] / "cache")
    streams = [build_data(cfg, d, dp, verbose=False)[0] for d in range(dp)]
    steps = [[(mb.input_ids, mb.labels) for s in streams for mb in s.batch(step)] for step in range(STEPS)]
    model = MiniMindForCausalLM(config)
    model.load_state_dict(torch.load(path, weights_only=True))
    return reference_train(model.train(), steps, cfg)


def assert_matches_reference(got: dict, reference: dict) -> None:
    """Per-step loss (rel 1e-5) and grad norm (rel 1e-4), every final parameter (rel 1e-4 in norm)."""
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5), "loss differs from the reference loop"
    assert got["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-4), \
        "grad norm differs from the reference loop"
    assert set(got["params"]) == set(reference["params"])
    for name, want in reference["params"].items():
        error = ((got["params"][name] - want).norm() / want.norm()).item()
        assert error <= 1e-4, f"parameter {name} differs from the reference loop by {error:.3g}"


def sluice_summary(results: list[dict]) -> dict:
    """Rank 0's losses and logged grad norms, and DP replica 0's parameters (whole, at tp=1 pp=1)."""
    from tests.equivalence import dense_params

    metrics = results[0]["metrics"]
    return {"losses": results[0]["losses"], "grad_norms": [m["grad_norm"] for m in metrics],
            "params": dense_params(results, tied=False)}


@pytest.mark.parametrize("name", list(CASES))
def test_one_process_equals_the_reference_loop(workspace, name):
    from parallel.grid import ParallelGrid

    case = CASES[name]
    path, _ = initial_weights(workspace, case)
    cfg = compose_run_config(overrides(workspace, case, path), workspace["root"] / "cache")
    result = run_training(cfg, ParallelGrid.single(torch.device("cpu")), workspace["root"] / name)
    if name == "chat":  # the loss really is on assistant tokens only, and some micro-batch counts differ
        counts = {int((mb.labels[:, 1:] != -100).sum()) for mb in result_batches(cfg)}
        assert len(counts) > 1, counts
    assert_matches_reference(sluice_summary([result]), reference_of(workspace, case, dp=1))


def result_batches(cfg) -> list:
    from training.data import build_data

    stream = build_data(cfg, 0, 1, verbose=False)[0]
    return [mb for step in range(STEPS) for mb in stream.batch(step)]


@pytest.mark.parametrize("name", list(DP2))
def test_dp2_equals_the_reference_loop(workspace, name):
    """Two replicas with different token counts: the global count, the synchronised norm, one schedule."""
    if not workspace["dp2"]:
        runs = [(overrides(workspace, case, initial_weights(workspace, case)[0]) + ["parallel.dp=2"],
                 str(workspace["root"] / n)) for n, case in DP2.items()]
        by_rank = run_workers(layouts_worker, 2, runs, str(workspace["root"] / "cache"), timeout=300)
        workspace["dp2"].update({n: [r[i] for r in by_rank] for i, n in enumerate(DP2)})
    assert_matches_reference(sluice_summary(workspace["dp2"][name]), reference_of(workspace, DP2[name], dp=2))


def test_the_reference_schedule_is_the_documented_one():
    """Warm-up to lr over warmup steps, then cosine to the floor at the last step (docs/configuration.md)."""
    lrs = [reference_lr(k, 10, 1.0, 2, 0.1) for k in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] == pytest.approx(0.1) and lrs[2:] == sorted(lrs[2:], reverse=True)
