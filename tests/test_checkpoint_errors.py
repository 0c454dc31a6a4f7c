"""Bad checkpoints get one clear line before training: another model, a missing path, corrupt files, NaN."""

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from checkpoint.dense import CheckpointError
from checkpoint.manager import COMPLETE, META
from parallel.grid import ParallelGrid
from tests.equivalence import compose_run_config
from training.config import ConfigError
from training.config.validate import validate
from training.trainer import Trainer

BASE = ["model=tiny", "train.steps=1", "schedule.n_microbatches=1", "checkpoint.save_final=true"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """A one-step, one-process checkpoint (the tokenizer cache beside it)."""
    root = tmp_path_factory.mktemp("errors")
    trainer = Trainer(compose_run_config(BASE, root / "cache"), ParallelGrid.single("cpu"), root / "run")
    trainer.fit()
    return root, root / "run" / "checkpoints" / "step_00000001"


def config(root: Path, *overrides: str):
    return compose_run_config([*BASE, *overrides], root / "cache")


def broken_copy(checkpoint: Path, target: Path) -> Path:
    shutil.copytree(checkpoint, target)
    return target


def test_another_model_config_names_the_field(saved):
    root, checkpoint = saved
    with pytest.raises(ConfigError, match=r"was written for model.hidden_size=64 but this run has "
                                          r"model.hidden_size=128"):
        validate(config(root, f"checkpoint.resume={checkpoint}", "model.hidden_size=128"))


def test_missing_path(saved):
    root, _ = saved
    with pytest.raises(ConfigError, match=r"checkpoint.resume=no/such/dir does not exist"):
        validate(config(root, "checkpoint.resume=no/such/dir"))


def test_a_partial_checkpoint_is_never_loaded(saved, tmp_path):
    root, checkpoint = saved
    partial = broken_copy(checkpoint, tmp_path / "step_00000001")
    (partial / COMPLETE).unlink()
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        validate(config(root, f"checkpoint.resume={partial}"))


def test_truncated_metadata_is_refused_before_launch(saved, tmp_path):
    root, checkpoint = saved
    bad = broken_copy(checkpoint, tmp_path / "step_00000001")
    (bad / ".metadata").write_bytes((bad / ".metadata").read_bytes()[:40])
    with pytest.raises(ConfigError, match="unreadable metadata .*corrupt or truncated"):
        validate(config(root, f"checkpoint.resume={bad}"))


def test_truncated_data_file_is_one_line(saved, tmp_path):
    root, checkpoint = saved
    bad = broken_copy(checkpoint, tmp_path / "step_00000001")
    data = next(bad.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    trainer = Trainer(config(root, f"checkpoint.resume={bad}"), ParallelGrid.single("cpu"), tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"is corrupt or truncated") as error:
        trainer.fit()
    assert "\n" not in str(error.value)


def test_no_checkpoint_is_written_with_non_finite_weights(saved, tmp_path):
    root, _ = saved
    trainer = Trainer(config(root, "checkpoint.every=1"), ParallelGrid.single("cpu"), tmp_path / "run")
    with torch.no_grad():
        trainer.engine.named_parameters()["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.down_proj.weight .*holds NaN or Inf"):
        trainer.checkpoints.save(1)
    assert not any((tmp_path / "run" / "checkpoints").glob("*step_*"))


def test_loading_non_finite_weights_is_refused(saved, tmp_path):
    root, checkpoint = saved
    dcp_to_torch_save(str(checkpoint), str(tmp_path / "flat.pt"))
    state = torch.load(tmp_path / "flat.pt", weights_only=True)
    state["model.norm.weight"][3] = float("nan")
    torch.save(state, tmp_path / "flat.pt")
    bad = tmp_path / "step_00000001"
    torch_save_to_dcp(str(tmp_path / "flat.pt"), str(bad))
    for name in (META, COMPLETE):
        shutil.copy(checkpoint / name, bad / name)
    trainer = Trainer(config(root, f"checkpoint.resume={bad}"), ParallelGrid.single("cpu"), tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"model.norm.weight holds NaN or Inf"):
        trainer.fit()
