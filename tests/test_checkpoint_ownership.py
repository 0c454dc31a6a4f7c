"""A run owns its checkpoint folder: another run is refused it (before launch, in one line) unless it resumes from
it, and nothing a run prunes, cleans or overwrites was saved by another run."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from checkpoint.checksums import SUMS, digest, sums_text
from checkpoint.dense import CheckpointError
from checkpoint.manager import ownership_problem, complete_checkpoints
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
        assert ownership_problem(checkpoint_spec(cfg, tmp_path / resume)) == line  # before launch
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


def as_saved_before_records(checkpoint: Path) -> None:
    """Drop meta.json's run_id (and re-sum it): a checkpoint saved before checkpoints recorded their run."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta.pop(RUN_ID)
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    sums = {name: value for value, name in (line.split("  ") for line in (checkpoint / SUMS).read_text().splitlines())}
    (checkpoint / SUMS).write_text(sums_text({**sums, "meta.json": digest(checkpoint / "meta.json")}))


def test_an_unclaimed_folder_is_refused_to_a_fresh_run_and_adopted_by_resuming_it(owned, tmp_path):
    root, _, folder = copy_of(owned, tmp_path)
    (folder / OWNER).unlink()  # saved before runs claimed folders
    as_saved_before_records(folder / "step_00000002")
    cfg = config(root, folder, "train.steps=3")
    assert ownership_problem(checkpoint_spec(cfg, tmp_path / "b")) == (
        f"checkpoint.dir={folder} holds checkpoints (step_00000002) that this run did not write; a run never prunes "
        "or overwrites another run's checkpoints: choose another checkpoint.dir, or continue them: "
        f"checkpoint.resume={folder / 'step_00000002'}")
    result = train(root, tmp_path / "b", folder, "checkpoint.resume=auto", steps=3)
    assert len(result["losses"]) == 1
    assert json.loads((folder / OWNER).read_text())["run_dir"] == str((tmp_path / "b").resolve())


# Issue 46, Why 2-5: ownership recorded in each checkpoint, never lost or stolen.

def test_each_checkpoint_records_the_run_that_wrote_it(owned):
    _, run, folder = owned
    meta = json.loads((folder / "step_00000002" / "meta.json").read_text())
    assert meta[RUN_ID] == (run / RUN_ID).read_text().strip()


def test_a_fresh_run_in_a_reused_run_directory_is_refused_without_metrics(tmp_path):
    from training.report.console import run_dir_problem

    run = tmp_path / "run"
    train(tmp_path, run, run / "checkpoints")
    (run / "metrics.jsonl").unlink(missing_ok=True)  # gone: the checkpoints still say whose they are
    for resume in (None, "none"):
        problem = run_dir_problem(run, resume, run / "checkpoints")
        assert problem.startswith(f"checkpoint.dir={run / 'checkpoints'} already holds checkpoints of an earlier run")
    assert run_dir_problem(run, "auto", run / "checkpoints") is None  # continuing them is what auto is for


def test_resume_auto_never_adopts_another_runs_checkpoints_without_an_owner(owned, tmp_path):
    root, _, folder = copy_of(owned, tmp_path)
    (folder / OWNER).unlink()  # their meta.json still records run A
    before = snapshot(folder)
    with pytest.raises(CheckpointError, match="that this run did not write"):
        train(root, tmp_path / "b", folder, "checkpoint.resume=auto", steps=3)
    assert snapshot(folder) == before  # step_2 neither adopted nor pruned
    result = train(root, tmp_path / "b", folder, f"checkpoint.resume={folder / 'step_00000002'}", steps=3)
    assert len(result["losses"]) == 1  # naming the checkpoint continues it


def test_resume_auto_never_follows_a_link_out_of_its_run_directory(owned, tmp_path):
    root, _, folder = copy_of(owned, tmp_path)
    (folder / OWNER).unlink()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "checkpoints").symlink_to(folder)
    before = snapshot(folder)
    with pytest.raises(CheckpointError, match=r"is a symbolic link .* never through a link"):
        run_training(compose_run_config([*TINY, "train.steps=3", "checkpoint.resume=auto"], root / "cache"),
                     ParallelGrid.single("cpu"), tmp_path / "b")
    assert snapshot(folder) == before


@pytest.mark.parametrize("damage", ["delete", "edit"])
def test_a_lost_owner_is_rewritten_from_the_runs_own_checkpoints(owned, tmp_path, caplog, damage):
    caplog.set_level("WARNING", logger="sluice")
    root, run, folder = copy_of(owned, tmp_path)
    if damage == "delete":
        (folder / OWNER).unlink()
    else:
        (folder / OWNER).write_text("{not json")
    result = train(root, run, folder, "checkpoint.resume=auto", steps=3)
    assert len(result["losses"]) == 1 and [p.name for p in complete_checkpoints(folder)] == ["step_00000003"]
    assert f"{OWNER} was {'missing' if damage == 'delete' else 'unreadable'}; rewritten from this run's own" \
        in caplog.text
    assert json.loads((folder / OWNER).read_text())["run_id"] == (run / RUN_ID).read_text().strip()


@pytest.mark.parametrize("name", [OWNER, RUN_ID])
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_owner_and_run_id_are_read_as_checked_files(owned, tmp_path, name, kind):
    import os

    root, run, folder = copy_of(owned, tmp_path)
    path = (folder if name == OWNER else run) / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # would block a plain read forever
    else:
        path.symlink_to("/dev/zero")  # would read without limit
    cfg = config(root, folder, "train.steps=3", "checkpoint.resume=auto")
    problem = ownership_problem(checkpoint_spec(cfg, run))
    expected = "a FIFO" if kind == "fifo" else "a character device"
    assert problem is not None and f"{name}: {path} is {expected}, not a regular file" in problem, problem
    assert len(problem.splitlines()) == 1
