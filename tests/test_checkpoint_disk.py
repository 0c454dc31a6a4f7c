"""A full or read-only checkpoint disk ends the run with one line naming the folder and the space needed, on every
rank alike, and the previous checkpoint stays complete and loadable; a flipped byte in a checkpoint is named.

The disks are real: a tmpfs of a few MB mounted for the test (root only; elsewhere these tests skip), remounted
read-only where a test needs it. One checkpoint of model=tiny takes about 5 MB, so an 8 MB disk holds one."""

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint import manager
from checkpoint.checksums import SUMS, check
from checkpoint.dense import CheckpointError
from checkpoint.disk import write_problem
from checkpoint.export import read_training_weights
from checkpoint.manager import COMPLETE, complete_checkpoints
from parallel.grid import ParallelGrid
from tests.conftest import ROOT
from tests.equivalence import compose_run_config
from tests.spawn import run_workers
from training.trainer import Trainer

TINY = ["model=tiny", "schedule.n_microbatches=1", "optim.warmup_steps=0", "train.steps=3", "checkpoint.every=1"]
STEP1 = "step_00000001"


def mount(path: Path, *options: str) -> None:
    out = subprocess.run(["mount", *options, str(path)], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {out.stderr.strip()}")


@pytest.fixture
def disk(tmp_path):
    """Mounts a tmpfs of a given size at tmp_path/disk (8 MB unless asked), unmounted afterwards."""
    path = tmp_path / "disk"
    path.mkdir()
    yield lambda size="8M": mount(path, "-t", "tmpfs", "-o", f"size={size}", "tmpfs") or path
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture
def small_disk(disk) -> Path:
    """An 8 MB tmpfs: one checkpoint fits, two do not."""
    return disk()


def files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def trainer(tmp_path: Path, folder: Path, *overrides: str) -> Trainer:
    cfg = compose_run_config([*TINY, f"checkpoint.dir={folder}", *overrides], tmp_path / "cache")
    return Trainer(cfg, ParallelGrid.single("cpu"), tmp_path / "run")


def assert_only_step1_kept(folder: Path, step1: dict[str, str]) -> None:
    """The step-1 checkpoint is complete, byte for byte as saved and passes its checksums; no partial save is left."""
    assert [p.name for p in complete_checkpoints(folder)] == [STEP1]
    assert files(folder / STEP1) == step1
    check(folder / STEP1)
    assert not list(folder.glob(".step_*"))


def fit_keeping_step1(run: Trainer, folder: Path, on_step2=lambda: None) -> tuple[dict[str, str], str]:
    """Fit `run` to its failing save, recording the step-1 checkpoint's files once saved: (those, the line)."""
    kept: dict[str, str] = {}

    def after(step: int) -> None:
        if step == 2:  # after step 1's save, before step 2's
            kept.update(files(folder / STEP1))
            on_step2()

    with pytest.raises(CheckpointError) as error:
        run.fit(on_step=after)
    assert "\n" not in str(error.value)
    return kept, str(error.value)


def test_a_full_disk_is_refused_before_writing_with_the_space_needed(small_disk, tmp_path):
    folder = small_disk / "checkpoints"
    kept, line = fit_keeping_step1(trainer(tmp_path, folder), folder)
    assert line.startswith(f"checkpoint of step 2 not written: {folder} has ")
    assert " MB free, the checkpoint needs about 4.9 MB; free space there or set checkpoint.dir to a larger disk" \
        in line, line
    assert_only_step1_kept(folder, kept)


def test_a_disk_filling_during_the_write_is_named_and_the_partial_save_removed(small_disk, tmp_path, monkeypatch):
    monkeypatch.setattr(manager, "space_problem", lambda *args: None)  # the disk fills after the check
    folder = small_disk / "checkpoints"
    kept, line = fit_keeping_step1(trainer(tmp_path, folder), folder)
    assert line == (f"checkpoint of step 2 not written: writing to {folder} failed: the disk is full (ENOSPC); the "
                    "checkpoint needs about 4.9 MB there: free space, make it writable or set checkpoint.dir to "
                    "another disk")
    assert_only_step1_kept(folder, kept)


def test_a_read_only_disk_is_named_and_the_previous_checkpoint_stays(disk, tmp_path):
    roomy = disk("32M")
    folder = roomy / "checkpoints"
    remount = lambda: mount(roomy, "-o", "remount,ro")  # noqa: E731  the disk turns read-only mid-run
    kept, line = fit_keeping_step1(trainer(tmp_path, folder), folder, remount)
    assert line == (f"checkpoint of step 2 not written: writing to {folder} failed: the disk is read-only (EROFS); "
                    "the checkpoint needs about 4.9 MB there: free space, make it writable or set checkpoint.dir to "
                    "another disk")
    assert_only_step1_kept(folder, kept)


def test_a_short_write_without_errno_on_a_full_disk_is_named(small_disk):
    """torch's zip writer reports a full disk as 'RuntimeError: ... unexpected pos' (seen in CI under dp2)."""
    with open(small_disk / "filler", "wb") as filler, pytest.raises(OSError):
        while True:
            filler.write(b"x" * 65536)
            filler.flush()
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert write_problem(error, small_disk, 5_000_000, "checkpoint of step 2 not written") == (
        f"checkpoint of step 2 not written: writing to {small_disk} failed: the disk is full (ENOSPC); the checkpoint "
        "needs about 5.0 MB there: free space, make it writable or set checkpoint.dir to another disk")
    (small_disk / "filler").unlink()
    assert write_problem(error, small_disk, 5_000_000, "x") is None  # room enough: not the disk's doing


def _dp2_full_disk_worker(rank: int, world_size: int, root: str, folder: str) -> tuple[str, list[str]]:
    """dp2: the disk fills inside DCP's write on both ranks; each returns its line and the folder's checkpoints."""
    real = manager.space_problem
    manager.space_problem = lambda *args: None
    try:
        cfg = compose_run_config([*TINY, f"checkpoint.dir={folder}", "parallel.dp=2"], Path(root) / "cache")
        run = Trainer(cfg, ParallelGrid.build(2, 1, 1, backend="gloo", timeout_s=60), Path(root) / "run")
        try:
            run.fit()
        except CheckpointError as error:
            return str(error), [p.name for p in complete_checkpoints(Path(folder))]
        return "", []
    finally:
        manager.space_problem = real


def test_dp2_ranks_fail_a_full_disk_alike(small_disk, tmp_path):
    folder = small_disk / "checkpoints"
    results = run_workers(_dp2_full_disk_worker, 2, str(tmp_path), str(folder), timeout=180)
    assert results[0] == results[1]  # the same line on every rank: no rank waits for a peer that left
    line, kept = results[0]
    assert line.startswith(f"checkpoint of step 2 not written: writing to {folder} failed: the disk is full "
                           "(ENOSPC); the checkpoint needs about "), line
    assert kept == [STEP1] and not list(folder.glob(".step_*"))


def test_train_py_dp2_on_a_full_disk_exits_1_with_one_line(small_disk, tmp_path):
    folder = small_disk / "checkpoints"
    out = subprocess.run([sys.executable, "train.py", *TINY, "parallel.dp=2", "logger=none",
                          f"checkpoint.dir={folder}", f"data.cache_dir={tmp_path / 'cache'}",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if line.startswith("sluice:")]
    line = rf"sluice: rank [01]: checkpoint of step 2 not written: {re.escape(str(folder))} has [\d.]+ MB free, the "
    assert len(said) == 1 and re.match(line + r"checkpoint needs about [\d.]+ MB; free space there", said[0]), said
    assert "Traceback" not in out.stderr and "SIGTERM" not in out.stderr and "died" not in out.stderr
    assert [p.name for p in complete_checkpoints(folder)] == [STEP1] and not list(folder.glob(".step_*"))
    check(folder / STEP1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A one-step checkpoint of model=tiny."""
    root = tmp_path_factory.mktemp("checksums")
    cfg = compose_run_config(["model=tiny", "schedule.n_microbatches=1", "train.steps=1", "checkpoint.save_final=true"],
                             root / "cache")
    Trainer(cfg, ParallelGrid.single("cpu"), root / "run").fit()
    return root / "run" / "checkpoints" / STEP1


def test_a_checkpoint_records_its_checksums_as_sha256sum_checks_them(saved):
    lines = (saved / SUMS).read_text().splitlines()
    assert sorted(line.split("  ")[1] for line in lines) == ["__0_0.distcp", "meta.json"]
    assert (saved / COMPLETE).stat().st_mtime >= (saved / SUMS).stat().st_mtime  # written before the marker
    out = subprocess.run(["sha256sum", "-c", SUMS], cwd=saved, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.count(": OK") == 2, out.stdout


def test_a_flipped_byte_is_named_on_resume_and_export(saved, tmp_path):
    flipped = tmp_path / "checkpoints" / STEP1
    shutil.copytree(saved, flipped)
    shard = flipped / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, inside a tensor's bytes: torch.load alone would read it silently
    shard.write_bytes(bytes(data))
    line = (f"checkpoint {flipped}: __0_0.distcp is corrupt or truncated: it fails its checksum (its sha256 differs "
            f"from the one {SUMS} recorded at save); resume from another checkpoint")
    with pytest.raises(CheckpointError) as error:
        trainer(tmp_path, tmp_path / "mine", "train.steps=2", f"checkpoint.resume={flipped}").fit()
    assert str(error.value) == line
    with pytest.raises(CheckpointError) as error:
        read_training_weights(flipped)
    assert str(error.value) == line


def test_a_checkpoint_saved_without_checksums_still_loads(saved, tmp_path):
    older = tmp_path / "checkpoints" / STEP1
    shutil.copytree(saved, older)
    (older / SUMS).unlink()  # as saved before checksums were recorded
    assert len(trainer(tmp_path, tmp_path / "mine", f"checkpoint.resume={older}").fit()) == 2
    assert read_training_weights(older)[1]["step"] == 1
