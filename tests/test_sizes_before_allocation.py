"""Sizes are computed from a config's fields in closed form and checked before anything is built or allocated
(issue 46, Why 6): a model that cannot fit, or a dimension torch cannot index, is one line naming the file and field;
`num_hidden_layers=1e9` never hangs."""

import json
import shutil
import time

import pytest

from checkpoint.dense import CheckpointError
from models import ModelError, config_from_record, model_config
from models.model_size import MAX_DIM, model_size, size_problem
from tests.test_scripts import exported, one_line_failure, script  # noqa: F401  (exported: a module fixture)

TINY = {"model_type": "minimind", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def test_the_closed_form_count_equals_the_built_model():
    from models import build_model

    for extra in ({}, {"use_moe": True, "num_experts": 4, "num_experts_per_tok": 2}, {"num_hidden_layers": 5}):
        record = {**TINY, **extra}
        built = build_model(config_from_record(record))
        assert model_size(record).parameters == sum(p.numel() for p in built.parameters()), extra


def test_a_billion_layers_is_one_line_at_once():
    start = time.perf_counter()
    problem = size_problem({**TINY, "num_hidden_layers": 10**9}, "meta.json's model")
    assert problem.startswith("meta.json's model num_hidden_layers=1000000000 is more than")
    with pytest.raises(ModelError, match="num_hidden_layers=1000000000"):
        model_config({"name": "tiny", **{k: v for k, v in TINY.items() if k != "model_type"},
                      "num_hidden_layers": 10**9})
    with pytest.raises(ModelError, match="num_hidden_layers=1000000000"):
        config_from_record({**TINY, "num_hidden_layers": 10**9})
    assert time.perf_counter() - start < 5


def test_sizes_beyond_torch_or_the_host_are_named():
    assert f"at most {MAX_DIM}" in size_problem({**TINY, "vocab_size": 2**40}, "where")
    assert "more than this host's 1.0 GiB" in size_problem({**TINY, "hidden_size": 10**6}, "where", 2**30)
    assert size_problem(TINY, "where", 2**30) is None


def test_an_hf_config_without_layer_types_does_not_hang(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 10**9,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "head_dim": 16}))
    start = time.perf_counter()
    with pytest.raises(ModelError, match=r"config.json's num_hidden_layers=1000000000"):
        model_config({"hf_config": str(tmp_path)})
    assert time.perf_counter() - start < 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from parallel.grid import ParallelGrid
    from tests.equivalence import compose_run_config, run_training

    root = tmp_path_factory.mktemp("sizes")
    cfg = compose_run_config(["model=tiny", "train.steps=1", "schedule.n_microbatches=1", "checkpoint.every=1",
                              f"checkpoint.dir={root / 'run' / 'checkpoints'}"], root / "cache")
    run_training(cfg, ParallelGrid.single("cpu"), root / "run")
    return root / "run" / "checkpoints" / "step_00000001"


def edited(checkpoint, tmp_path, field, value):
    """A copy of the checkpoint whose meta.json's model sets `field` (checksums off: the values are what is tested)."""
    copy = tmp_path / "step_00000001"
    shutil.copytree(checkpoint, copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["model"][field] = value
    (copy / "meta.json").write_text(json.dumps(meta))
    (copy / "SHA256SUMS").unlink()
    return copy


@pytest.mark.parametrize("field, value, expected", [
    ("num_hidden_layers", 10**9, "meta.json's model num_hidden_layers=1000000000 is more than"),
    ("hidden_size", 10**9, "more than this host's"),
    ("vocab_size", 0, "meta.json's model vocab_size=0 must be a positive integer")])
def test_export_checks_meta_sizes_before_building(checkpoint, tmp_path, capsys, field, value, expected):
    copy = edited(checkpoint, tmp_path, field, value)
    start = time.perf_counter()
    line = one_line_failure(script("export_hf"), [str(copy), str(tmp_path / "out")], capsys)
    assert expected in line and str(copy) in line, line
    assert time.perf_counter() - start < 30 and not (tmp_path / "out").exists()


def test_a_teacher_too_large_is_refused_before_launch(checkpoint, tmp_path):
    from training.methods.distill.teacher import teacher_config

    copy = edited(checkpoint, tmp_path, "hidden_size", 2**40)
    with pytest.raises(ModelError, match=r"distill.teacher=.*: meta.json's model hidden_size=1099511627776 is beyond"):
        teacher_config(str(copy))


def test_generate_checks_the_folder_size_before_loading(exported, tmp_path, capsys):
    root, _ = exported
    folder = tmp_path / "hf"
    shutil.copytree(root / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    line = one_line_failure(script("generate"), [str(folder), "hi"], capsys)
    assert "config.json's num_hidden_layers=1000000000 is more than" in line
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 2**20, "intermediate_size": 2**20}))
    line = one_line_failure(script("generate"), [str(folder), "hi"], capsys)
    assert "more than this host's" in line


def test_a_teacher_shard_linked_to_a_device_is_refused_before_launch(checkpoint, tmp_path):
    from omegaconf import OmegaConf

    from training.methods.distill.teacher import teacher_problem

    copy = tmp_path / "step_00000001"
    shutil.copytree(checkpoint, copy)
    shard = next(copy.glob("*.distcp"))
    shard.unlink()
    shard.symlink_to("/dev/zero")
    cfg = OmegaConf.create({"train": {"task": "distill"}, "distill": {"teacher": str(copy)}})
    problem = teacher_problem(cfg, 300)
    assert problem.startswith(f"distill.teacher={copy}") and "leads outside" in problem and "/dev/zero" in problem


def test_a_derived_width_beyond_torch_is_named():
    """MiniMind's MLP width follows hidden_size: 1e9 makes it 3.1e9 and the weight's bytes overflow int64."""
    problem = size_problem({**TINY, "hidden_size": 10**9}, "model:")
    assert problem.startswith("model: sizes make a dimension of 3141592704, beyond what torch can index")
    assert "hidden_size=1000000000" in problem
