"""A run owns its checkpoint folder: another run is refused it (before launch, in one line) unless it resumes from
it, and nothing a run prunes, cleans or overwrites was saved by another run."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from checkpoint.dense import CheckpointError
from checkpoint.manager import check_ownership, complete_checkpoints
from checkpoint.ownership import OWNER, RUN_ID
from parallel.grid import ParallelGrid
from tests.equivalence import compose_run_config, run_training
from training.specs import checkpoint_spec
from training.trainer import Trainer

TINY = ["model=tiny", "schedule.n_microbatches=1", "optim.warmup_steps=0", "checkpoint.every=1",
        "checkpoint.keep_last=1"]


def config(root: Path, folder: Path, *overrides: str):
    return compose_run_config([*TINY, f"checkpoint.dir={folder}", *overrides], root / "cache")


def train(root: Path, run: Path, folder: Path, *overrides: str, steps: int = 2) -> dict:
    return run_training(config(root, folder, f"train.steps={steps}", *overrides), ParallelGrid.single("cpu"), run)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) -> the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def owned(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Run A trained 2 steps into a checkpoint.dir outside its run directory: (root, A's run dir, the folder)."""
    root = tmp_path_factory.mktemp("ownership")
    train(root, root / "a", root / "shared")
    return root, root / "a", root / "shared"


def copy_of(owned, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of run A and its folder (the same run: its run_id travels with the run directory)."""
    root, run, folder = owned
    shutil.copytree(run, tmp_path / "a")
    shutil.copytree(folder, tmp_path / "shared")
    return root, tmp_path / "a", tmp_path / "shared"


def test_the_first_save_records_the_run_that_owns_the_folder(owned):
    _, run, folder = owned
    owner = json.loads((folder / OWNER).read_text())
    assert owner == {"run_id": (run / RUN_ID).read_text().strip(), "run_dir": str(run.resolve())}
    assert [p.name for p in complete_checkpoints(folder)] == ["step_00000002"]  # keep_last=1 pruned its own step 1


def test_a_fresh_run_is_refused_another_runs_folder_and_changes_nothing_in_it(owned, tmp_path):
    root, run, folder = owned
    (folder / ".step_00000009.tmp").mkdir()  # a save of run A in flight (or killed): never another run's to remove
    before = snapshot(folder)
    line = (f"checkpoint.dir={folder} belongs to another run ({run.resolve()}); a run never prunes or overwrites "
            "another run's checkpoints: choose another checkpoint.dir, or continue that run here by naming its "
            f"checkpoint: checkpoint.resume={folder / 'step_00000002'} (resume=auto continues only this run's own)")
    for resume in ("none", "auto"):
        cfg = config(root, folder, "train.steps=2", f"checkpoint.resume={resume}")
        assert check_ownership(checkpoint_spec(cfg, tmp_path / resume)) == line  # before launch
        with pytest.raises(CheckpointError) as error:  # and in the workers, before the first step
            Trainer(cfg, ParallelGrid.single("cpu"), tmp_path / resume).fit()
        assert str(error.value) == line
    assert snapshot(folder) == before
    shutil.rmtree(folder / ".step_00000009.tmp")


def test_train_py_refuses_another_runs_folder_before_launch(owned, tmp_path, capsys):
    """train.py's path in this process (tests/test_config_errors.py's launch_here): refused before any worker."""
    from tests.test_config_errors import launch_here

    root, run, folder = owned
    out = launch_here([*TINY, "train.steps=2", "logger=none", f"checkpoint.dir={folder}",
                       f"data.cache_dir={root / 'cache'}", f"hydra.run.dir={tmp_path / 'b'}"], capsys)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sluice: config error: checkpoint.dir={folder} belongs to another "
                                                   f"run ({run.resolve()})"), out.stderr
    assert not (tmp_path / "b" / "metrics.jsonl").exists()  # no worker started


def test_the_same_run_resumes_auto_and_prunes_its_own(owned, tmp_path):
    root, run, folder = copy_of(owned, tmp_path)
    (folder / ".step_00000003.tmp").mkdir()  # its own save killed earlier: removed by its next save
    result = train(root, run, folder, "checkpoint.resume=auto", steps=3)
    assert len(result["losses"]) == 1  # step 3 only: resumed after step 2
    assert [p.name for p in complete_checkpoints(folder)] == ["step_00000003"]
    assert not (folder / ".step_00000003.tmp").exists()


def test_a_run_naming_the_checkpoint_continues_it_and_takes_the_folder_over(owned, tmp_path, caplog):
    caplog.set_level("INFO", logger="sluice")
    root, run, folder = copy_of(owned, tmp_path)
    result = train(root, tmp_path / "b", folder, f"checkpoint.resume={folder / 'step_00000002'}", steps=3)
    assert len(result["losses"]) == 1
    assert f"this run continues {owned[1].resolve()}'s checkpoints" in caplog.text  # as OWNER named A
    assert json.loads((folder / OWNER).read_text())["run_dir"] == str((tmp_path / "b").resolve())
    assert [p.name for p in complete_checkpoints(folder)] == ["step_00000003"]  # its history now: keep_last=1
    with pytest.raises(CheckpointError, match=rf"belongs to another run \({tmp_path / 'b'}\)"):
        train(root, run, folder, "checkpoint.resume=auto", steps=4)  # A again: the folder is B's now


def test_of_two_runs_starting_at_once_the_second_to_save_is_refused(tmp_path):
    root = tmp_path
    second = Trainer(config(root, tmp_path / "shared", "train.steps=2"), ParallelGrid.single("cpu"), tmp_path / "b")
    assert second.checkpoints.resume() == 0  # the folder is empty: both start (a sweep's jobs sharing it)
    train(root, tmp_path / "a", tmp_path / "shared")
    before = snapshot(tmp_path / "shared")
    with pytest.raises(CheckpointError, match=r"checkpoint of step 2 not written: checkpoint.dir=.* belongs to "
                                              rf"another run \({tmp_path / 'a'}\)"):
        second.checkpoints.save(2)
    assert snapshot(tmp_path / "shared") == before  # A's step_2 neither overwritten nor pruned


def test_an_unclaimed_folder_is_refused_to_a_fresh_run_and_adopted_by_resuming_it(owned, tmp_path):
    root, _, folder = copy_of(owned, tmp_path)
    (folder / OWNER).unlink()  # saved before runs claimed folders
    cfg = config(root, folder, "train.steps=3")
    assert check_ownership(checkpoint_spec(cfg, tmp_path / "b")) == (
        f"checkpoint.dir={folder} holds checkpoints (step_00000002) that this run did not write; a run never prunes "
        "or overwrites another run's checkpoints: choose another checkpoint.dir, or continue them: "
        f"checkpoint.resume={folder / 'step_00000002'}")
    result = train(root, tmp_path / "b", folder, "checkpoint.resume=auto", steps=3)
    assert len(result["losses"]) == 1
    assert json.loads((folder / OWNER).read_text())["run_dir"] == str((tmp_path / "b").resolve())
