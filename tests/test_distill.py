"""train.task=distill: a student trained on its labels and a teacher's temperature-softened logits (MiniMind's
train_distillation.py), the teacher another size, loaded from a save_pretrained folder.

Sluice's one process against a plain PyTorch loop written here (student and teacher modules, MiniMind's loss written
out); pipeline, DP and TP x PP layouts against one process (the equivalence harness, one spawn of world 2); the
one-line refusals of a missing or unfit teacher.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from minimind import MiniMindConfig, MiniMindForCausalLM
from tests.equivalence import (EMU, Layout, assert_equivalent, assert_params_match_plain_loop, baseline,
                               compose_run_config, layouts_worker)
from tests.shared import once_per_session
from tests.spawn import run_workers
from tests.test_reference_loop import reference_lr

pytestmark = pytest.mark.timeout(900)

ALPHA, T = 0.3, 2.0  # not the defaults (0.5, 1.5): a weight or temperature not applied changes every number below
STUDENT = ["model=tiny", "train.task=distill", f"distill.alpha={ALPHA}", f"distill.temperature={T}",
           "train.steps=2", "schedule.n_microbatches=4", "optim.weight_decay=0.5", "train.grad_clip=1.0",
           "data.val_fraction=0.15", "train.eval_every=2", "train.eval_batches=2"]  # held-out batches meet the teacher
# The teacher: twice as wide, half as deep, a larger vocabulary (cut to the student's, as MiniMind does).
TEACHER = dict(vocab_size=2048 + 64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256)
LAYOUTS = [Layout("pp2-1f1b", [], ["parallel.pp=2", "schedule=1f1b"], 2, 1),
           Layout("dp2", [], ["parallel.dp=2"], 2, 2),
           Layout("tp2-pp2-1f1b-emu", [], ["parallel.tp=2", "parallel.pp=2", "schedule=1f1b", EMU], 2, 1),
           # V placement (the last stage on pipeline rank 0) and the split backward around the teacher's forward
           Layout("dp2-zbv-emu", [], ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=zbv", EMU], 2, 2),
           Layout("dp2-zero3", [], ["parallel.dp=2", "parallel.zero=3"], 2, 2)]  # FSDP's shards; the teacher whole


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    torch.manual_seed(7)
    MiniMindForCausalLM(MiniMindConfig(**TEACHER)).save_pretrained(root / "teacher")
    torch.manual_seed(11)  # the student's starting weights, as a file the plain loop reads too
    torch.save(student_of(compose_run_config(STUDENT, root / "cache")).state_dict(), root / "student.pth")
    return {"root": root, "baselines": {}, "results": {}, "factory": tmp_path_factory}


def student_of(cfg) -> MiniMindForCausalLM:
    """A MiniMind model of the run config's model section (fresh weights)."""
    fields = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if v is not None and k != "name"}
    return MiniMindForCausalLM(MiniMindConfig(**fields))


def run_args(workspace) -> list[str]:
    root = workspace["root"]
    return [*STUDENT, f"distill.teacher={root / 'teacher'}", f"checkpoint.load_dense={root / 'student.pth'}"]


def single_process(workspace, dp: int = 1) -> tuple[dict, Path]:
    """One process over the global batch of `dp` replicas: its results and its run directory (memoised)."""
    if dp not in workspace["baselines"]:
        run_dir = workspace["root"] / f"baseline-dp{dp}"
        args = [*run_args(workspace), "checkpoint.save_final=true"]  # a run to teach from (test_a_run_teaches)
        workspace["baselines"][dp] = baseline(args, workspace["root"] / "cache", run_dir, dp), run_dir
    return workspace["baselines"][dp]


# --- an independent reference: the plain PyTorch loop ---------------------------------------------------------------


def minimind_distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """MiniMind's distillation_loss: T^2 * KL(softmax(teacher / T) || softmax(student / T)), batchmean over rows."""
    teacher_probs = F.softmax(teacher / temperature, dim=-1)
    kl = F.kl_div(F.log_softmax(student / temperature, dim=-1), teacher_probs, reduction="batchmean")
    return temperature ** 2 * kl


def plain_distill(student: torch.nn.Module, teacher: torch.nn.Module, steps: list[list], cfg) -> dict:
    """MiniMind's train_epoch written out: per micro-batch `alpha * CE + (1 - alpha) * distill`, each a mean over the
    micro-batch's label positions, the teacher's logits cut to the student's vocabulary; a step's micro-batches
    weighted by their share of its label tokens (MiniMind's 1 / accumulation_steps where they hold as many, as
    here); clipping, AdamW with decay on linear and embedding weights, warm-up then cosine."""
    o = cfg.optim
    decay = {id(m.weight) for m in student.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    groups = [{"params": [p for p in student.parameters() if id(p) in decay], "weight_decay": o.weight_decay},
              {"params": [p for p in student.parameters() if id(p) not in decay], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    losses, parts = [], []
    for step, micro_batches in enumerate(steps):
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(step, len(steps), o.lr, o.warmup_steps, o.min_lr_ratio)
        total = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro_batches)
        loss_sum, ce_sum, kl_sum = 0.0, 0.0, 0.0
        for ids, labels in micro_batches:
            logits = student(input_ids=ids).logits[:, :-1]
            with torch.no_grad():
                teacher_logits = teacher(input_ids=ids).logits[:, :-1, :logits.shape[-1]]
            mask = (labels[:, 1:] != -100).flatten()
            flat = logits.flatten(0, 1)
            ce = F.cross_entropy(flat, labels[:, 1:].flatten(), ignore_index=-100)
            distill = minimind_distillation_loss(flat[mask], teacher_logits.flatten(0, 1)[mask], T)
            loss = ALPHA * ce + (1 - ALPHA) * distill
            share = int(mask.sum()) / total
            (loss * share).backward()
            loss_sum, ce_sum, kl_sum = loss_sum + loss.item() * share, ce_sum + ce.item() * share, \
                kl_sum + distill.item() * share
        torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss_sum)
        parts.append({"ce_loss": ce_sum, "distill_loss": kl_sum})
    return {"losses": losses, "parts": parts, "params": {n: p.detach().clone() for n, p in student.named_parameters()}}


def test_one_process_equals_a_plain_pytorch_distillation_loop(workspace):
    from training.data import build_data

    result, run_dir = single_process(workspace)
    cfg = compose_run_config(run_args(workspace), workspace["root"] / "cache")
    stream = build_data(cfg, 0, 1, verbose=False)[0]
    steps = [[(mb.input_ids, mb.labels) for mb in stream.batch(step)] for step in range(cfg.train.steps)]
    student = student_of(cfg)
    student.load_state_dict(torch.load(cfg.checkpoint.load_dense, weights_only=True))
    teacher = MiniMindForCausalLM.from_pretrained(workspace["root"] / "teacher").eval().requires_grad_(False)
    want = plain_distill(student.train(), teacher, steps, cfg)

    assert result["losses"] == pytest.approx(want["losses"], rel=1e-5)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record, part in zip(records, want["parts"], strict=True):
        assert [record["ce_loss"], record["distill_loss"]] == pytest.approx([part["ce_loss"], part["distill_loss"]],
                                                                            rel=1e-5)
        assert record["loss"] == pytest.approx(ALPHA * record["ce_loss"] + (1 - ALPHA) * record["distill_loss"])
    last = records[-1]  # the held-out batches: the same two terms, no perplexity of a mixed loss
    assert "val_ppl" not in last and 0 < last["val_distill_loss"] < last["val_ce_loss"]
    assert last["val_loss"] == pytest.approx(ALPHA * last["val_ce_loss"] + (1 - ALPHA) * last["val_distill_loss"])
    assert_params_match_plain_loop(result, want["params"])


# --- layouts against one process -------------------------------------------------------------------------------------


def layout_results(workspace, case: Layout) -> list[dict]:
    """Every rank's results; the layouts (all of world size 2) train in one spawn."""
    if not workspace["results"]:
        def compute(root: Path) -> dict[str, list[dict]]:
            runs = [([*run_args(workspace), *c.layout], str(root / c.name)) for c in LAYOUTS]
            by_rank = run_workers(layouts_worker, 2, runs, str(workspace["root"] / "cache"), timeout=600)
            return {c.name: [r[i] for r in by_rank] for i, c in enumerate(LAYOUTS)}

        workspace["results"].update(once_per_session(workspace["factory"], "distill-layouts-world2", compute))
    return workspace["results"][case.name]


@pytest.mark.parametrize("case", LAYOUTS, ids=[case.name for case in LAYOUTS])
def test_layout_equals_single_process(workspace, case):
    reference, _ = single_process(workspace, case.dp)
    assert_equivalent(layout_results(workspace, case), reference)  # losses, grad norms, data, gradients, parameters


def test_a_sluice_run_teaches_with_its_trained_weights(workspace):
    """distill.teacher=<run directory>: its newest checkpoint, loaded whole and frozen, is the trained model."""
    from training.config.validate import validate
    from training.methods.distill.teacher import load_teacher

    result, run_dir = single_process(workspace)
    teacher = load_teacher(str(run_dir), torch.device("cpu"))
    trained = {name: tensor for name, (tensor, *_) in result["params"].items()}
    loaded = dict(teacher.module.named_parameters())
    assert set(loaded) == set(trained)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, trained[name]) and not tensor.requires_grad, name
    assert not teacher.module.training
    cfg = compose_run_config([*STUDENT, f"distill.teacher={run_dir}"], workspace["root"] / "cache")
    assert validate(cfg) == []


# --- configuration ---------------------------------------------------------------------------------------------------


def test_an_unfit_teacher_is_refused_in_one_line(workspace, tmp_path):
    from training.config import ConfigError
    from training.config.validate import validate
    from training.data import run_data_spec
    from training.data.tokenizer import build_tokenizer

    small = tmp_path / "small"
    MiniMindForCausalLM(MiniMindConfig(**TEACHER | {"vocab_size": 1024})).save_pretrained(small)
    (tmp_path / "empty").mkdir()
    cases = {
        (): "train.task=distill needs a teacher: set distill.teacher=<an HF folder (save_pretrained, "
            "scripts/export_hf.py) or a Sluice run directory or checkpoint>",
        (f"distill.teacher={tmp_path / 'missing'}",):
            f"distill.teacher={tmp_path / 'missing'} does not exist; give an HF folder (save_pretrained, "
            "scripts/export_hf.py) or a Sluice run directory or checkpoint",
        (f"distill.teacher={tmp_path / 'empty'}",):
            f"distill.teacher={tmp_path / 'empty'} is neither an HF folder (no config.json), a MiniMind .pth nor a "
            "Sluice training checkpoint; give a folder written by save_pretrained or scripts/export_hf.py, a .pth or "
            "a run directory",
        (f"distill.teacher={small}",):
            f"distill.teacher={small} has a vocabulary of 1024 tokens, the student 2048; the teacher's logits must "
            "cover the student's vocabulary (a teacher of the same tokenizer)",
    }
    for extra, message in cases.items():
        with pytest.raises(ConfigError) as error:
            validate(compose_run_config([*STUDENT, *extra], workspace["root"] / "cache"))
        assert str(error.value) == message
    other = tmp_path / "other-tokenizer"  # the teacher with the embedded tokenizer of another corpus size
    shutil.copytree(workspace["root"] / "teacher", other)
    build_tokenizer(run_data_spec(compose_run_config([*STUDENT, "data.num_docs=400"], tmp_path))).save_pretrained(other)
    with pytest.raises(ConfigError, match=rf"^distill.teacher={other} was trained with another tokenizer than this "
                                          r"run's \(the embedded tokenizer of data.num_docs=300, .*\): \d+ of this "
                                          r"run's \d+ tokens have other ids there; set data.num_docs and data.seed"):
        validate(compose_run_config([*STUDENT, f"distill.teacher={other}"], workspace["root"] / "cache"))
    teacher = f"distill.teacher={workspace['root'] / 'teacher'}"
    with pytest.raises(ConfigError, match=r"^distill.teacher=.* is read only when train.task=distill \(here "
                                          r"train.task=pretrain\); drop distill.teacher or change train.task$"):
        validate(compose_run_config(["model=tiny", teacher], workspace["root"] / "cache"))
    assert validate(compose_run_config([*STUDENT, teacher], workspace["root"] / "cache")) == []
