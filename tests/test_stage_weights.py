"""Stage to stage as MiniMind: with checkpoint.export_pth=true a run writes `<run>/out/<stage>_<hidden>.pth` (fp16,
every key) at each save, and the next stage's checkpoint.load_dense takes it, no export_hf.py between them;
`export_hf.py --format pth` names the file by the run's task; an HF folder exports to .pth with its own config."""

from pathlib import Path

import pytest
import torch

from checkpoint.export import read_training_weights
from parallel.grid import ParallelGrid
from tests.equivalence import compose_run_config, run_training
from tests.test_scripts import script

TINY = ["model=tiny", "train.steps=2", "checkpoint.save_final=true", "checkpoint.export_pth=true"]


def train(overrides: list[str], run_dir: Path, cache: Path) -> dict:
    return run_training(compose_run_config(overrides, cache), ParallelGrid.single(torch.device("cpu")), run_dir)


@pytest.fixture(scope="module")
def stages(tmp_path_factory, data_cache) -> Path:
    """Pretrain -> SFT -> DPO, each of two steps started from the .pth the stage before wrote, writing its own."""
    root = tmp_path_factory.mktemp("stages")
    train(TINY, root / "pretrain", data_cache)
    pth = root / "pretrain" / "out" / "pretrain_64.pth"
    train([*TINY, "train.task=sft", "data.format=chat", f"checkpoint.load_dense={pth}"], root / "sft", data_cache)
    sft = root / "sft" / "out" / "full_sft_64.pth"
    train([*TINY, "train.task=dpo", "data.format=chat", f"checkpoint.load_dense={sft}"], root / "dpo", data_cache)
    return root


def test_a_run_writes_minimind_stage_weights_at_each_save(stages):
    weights = torch.load(stages / "pretrain" / "out" / "pretrain_64.pth", weights_only=True)
    state, meta = read_training_weights(stages / "pretrain")
    assert meta["task"] == "pretrain" and set(weights) == set(state) and "lm_head.weight" in weights
    assert all(w.dtype == torch.float16 for w in weights.values())  # MiniMind's lm_checkpoint: .half()
    assert all(torch.equal(weights[k], state[k].half()) for k in state)
    assert not list((stages / "pretrain" / "out").glob(".*"))  # written under a temporary name, renamed


def test_the_next_stage_starts_from_the_file_the_run_wrote(stages, data_cache, tmp_path):
    assert sorted(p.name for p in (stages / "sft" / "out").iterdir()) == ["full_sft_64.pth"]
    assert sorted(p.name for p in (stages / "dpo" / "out").iterdir()) == ["dpo_64.pth"]
    start = torch.load(stages / "pretrain" / "out" / "pretrain_64.pth", weights_only=True)
    no_steps = train([*TINY, "train.task=sft", "data.format=chat", "optim.lr=0", "optim.weight_decay=0",
                      f"checkpoint.load_dense={stages / 'pretrain' / 'out' / 'pretrain_64.pth'}"], tmp_path, data_cache)
    for name, (value, *_) in no_steps["params"].items():  # lr 0: the SFT's weights are the file's, as loaded
        torch.testing.assert_close(value, start[name].float(), rtol=0, atol=0)


def test_export_names_the_pth_by_the_run_task(stages, tmp_path, capsys):
    export = script("export_hf")
    assert export.main([str(stages / "sft"), str(tmp_path / "pth"), "--format", "pth"]) == 0
    assert [p.name for p in (tmp_path / "pth").iterdir()] == ["full_sft_64.pth"]
    half = torch.load(tmp_path / "pth" / "full_sft_64.pth", weights_only=True)
    state, _ = read_training_weights(stages / "sft")
    assert {v.dtype for v in half.values()} == {torch.float16}  # MiniMind's precision, half the bytes of fp32
    assert all(torch.equal(half[k], state[k].half()) for k in state)
    assert export.main([str(stages / "sft"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    # an HF folder to .pth: its config.json gives the model (no model=... needed)
    assert export.main([str(tmp_path / "hf"), str(tmp_path / "again.pth"), "--format", "pth", "--pth-dtype", "fp32"]) \
        == 0, capsys.readouterr().err
    again = torch.load(tmp_path / "again.pth", weights_only=True)
    assert set(again) == set(state) and all(torch.equal(again[k], state[k]) for k in state)


def test_a_stage_pth_is_a_teacher_its_config_read_from_its_shapes(stages, data_cache):
    from training.methods.distill.teacher import load_teacher, teacher_problem

    pth = stages / "sft" / "out" / "full_sft_64.pth"
    cfg = compose_run_config(["model=tiny", "train.task=distill", "data.format=chat", f"distill.teacher={pth}"],
                             data_cache)
    assert teacher_problem(cfg, cfg.model.vocab_size) is None
    teacher = load_teacher(str(pth), torch.device("cpu"))
    weights = torch.load(pth, weights_only=True)
    assert teacher.config.num_hidden_layers == 4 and teacher.config.num_key_value_heads == 2
    assert all(torch.equal(p, weights[k].float()) for k, p in teacher.module.state_dict().items())
