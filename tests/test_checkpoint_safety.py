"""Checkpoints are safe to share and to kill: no pickle in one runs code, and no folder of one leaks."""

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from checkpoint.dense import CheckpointError
from checkpoint.export import read_training_weights
from checkpoint.manager import COMPLETE, META, resume_problem, complete_checkpoints, prune
from checkpoint.safe_reader import METADATA_FILE, RestrictedUnpickler
from parallel.grid import ParallelGrid
from tests.equivalence import compose_run_config, run_training

TINY = ["model=tiny", "train.steps=1", "schedule.n_microbatches=1"]


class Payload:
    """Unpickles to `value` after writing `marker`: what a crafted checkpoint would do, harmlessly."""

    def __init__(self, marker: Path, value: bytes):
        self.marker, self.value = marker, value

    def __reduce__(self):
        code = f"(__import__('pathlib').Path({str(self.marker)!r}).write_text('ran'), __import__('pickle').loads(" \
               f"{self.value!r}))[1]"
        return eval, (code,)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A one-step training run's run directory with its final checkpoint."""
    root = tmp_path_factory.mktemp("trust")
    cfg = compose_run_config([*TINY, "checkpoint.save_final=true"], root / "cache")
    run_training(cfg, ParallelGrid.single("cpu"), root / "run")
    return root / "run"


def poisoned_copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run whose checkpoint's `.metadata` runs a payload; returns (checkpoint, marker)."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    checkpoint = next((run / "checkpoints").glob("step_*"))
    marker = tmp_path / "payload-ran"
    real = (checkpoint / METADATA_FILE).read_bytes()
    (checkpoint / METADATA_FILE).write_bytes(pickle.dumps(Payload(marker, real)))
    assert pickle.loads((checkpoint / METADATA_FILE).read_bytes()) is not None and marker.exists()  # it is live
    marker.unlink()
    return checkpoint, marker


def test_the_payload_in_metadata_never_runs_on_resume_auto_or_export(saved, tmp_path):
    checkpoint, marker = poisoned_copy(saved, tmp_path)
    model = {"name": "tiny"}
    for resume, directory in ((str(checkpoint), None), ("auto", checkpoint.parent)):
        problem = resume_problem(resume, directory, model)
        assert problem is not None and "builtins.eval" in problem and str(checkpoint) in problem, problem
        assert "\n" not in problem
    cfg = compose_run_config([*TINY, "train.steps=2", "checkpoint.resume=auto",
                              f"checkpoint.dir={checkpoint.parent}"], tmp_path / "cache")
    with pytest.raises(CheckpointError, match=r"names builtins\.eval, which DCP checkpoint metadata never holds"):
        run_training(cfg, ParallelGrid.single("cpu"), checkpoint.parent.parent)  # the copied run continues itself
    with pytest.raises(CheckpointError, match="builtins.eval"):
        read_training_weights(checkpoint)
    assert not marker.exists()


def test_train_py_refuses_the_payload_before_launch_in_one_line(saved, tmp_path, monkeypatch, capsys):
    """train.py's pre-launch check, through its entry point in this process (it ends before Hydra runs)."""
    from tests.test_config_errors import train_py_here

    checkpoint, marker = poisoned_copy(saved, tmp_path)
    out = train_py_here([*TINY, f"checkpoint.resume={checkpoint}", "logger=none",
                         f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'again'}"], monkeypatch,
                        capsys)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to unpickle" in lines[0] and "builtins.eval" in lines[0], lines
    assert not marker.exists() and not (tmp_path / "again").exists()


def test_a_pickled_object_key_is_refused(saved, tmp_path):
    """DCP would torch.load(weights_only=False) a key stored as bytes: the metadata check refuses it first."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "bytes"
    dcp.save({"w": torch.zeros(2), "extra": {"any": "object"}}, storage_writer=dcp.FileSystemWriter(str(folder)),
             no_dist=True)
    with pytest.raises(CheckpointError, match=r"extra\S* is stored as a pickled object"):
        from checkpoint.distributed import read_keys

        read_keys(folder)


def test_a_metadata_field_renamed_by_a_flipped_byte_is_one_line(tmp_path):
    """Found by scripts/fuzz.py's 30-minute soak: a `.metadata` whose pickled field name lost a byte unpickled to a
    Metadata without `state_dict_metadata`, and the check raised AttributeError (a traceback) instead of refusing."""
    import torch.distributed.checkpoint as dcp

    from checkpoint.safe_reader import load_metadata

    folder = tmp_path / "flipped"
    dcp.save({"w": torch.zeros(2)}, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    raw = (folder / METADATA_FILE).read_bytes()
    assert raw.count(b"state_dict_metadata") == 1
    (folder / METADATA_FILE).write_bytes(raw.replace(b"state_dict_metadata", b" tate_dict_metadata"))
    with pytest.raises(CheckpointError, match="its metadata lacks the field 'state_dict_metadata'; the checkpoint is "
                                              "corrupt or was crafted"):
        load_metadata(folder / METADATA_FILE)


def test_a_payload_in_the_tensor_data_is_refused_by_weights_only(saved, tmp_path):
    """The tensor files are pickles too: point the RNG state at a payload; loading refuses it, nothing runs."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    checkpoint = next((run / "checkpoints").glob("step_*"))
    marker = tmp_path / "payload-ran"
    buffer = io.BytesIO()
    # As many bytes as the RNG state it replaces: the metadata's lengths still hold, so weights_only is what refuses
    torch.save(Payload(marker, pickle.dumps(torch.zeros(4096))), buffer)
    metadata = RestrictedUnpickler(open(checkpoint / METADATA_FILE, "rb"), checkpoint).load()
    key = next(k for k in metadata.storage_data if k.fqn.startswith("rng/"))
    data_file = checkpoint / metadata.storage_data[key].relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[key] = _StorageInfo(metadata.storage_data[key].relative_path, offset,
                                              len(buffer.getvalue()))
    (checkpoint / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    (checkpoint / "SHA256SUMS").unlink()  # else the shard's checksum refuses it first: weights_only is under test
    cfg = compose_run_config([*TINY, "train.steps=2", f"checkpoint.resume={checkpoint}"], tmp_path / "cache")
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        run_training(cfg, ParallelGrid.single("cpu"), tmp_path / "resumed")
    assert not marker.exists()


def test_a_dense_weights_file_with_a_payload_is_refused(tmp_path):
    from checkpoint.dense import read_dense_state_dict as load_dense_state

    marker = tmp_path / "payload-ran"
    torch.save({"model.embed_tokens.weight": Payload(marker, pickle.dumps(torch.zeros(1)))}, tmp_path / "w.pth")
    with pytest.raises(CheckpointError):
        load_dense_state(tmp_path / "w.pth")
    assert not marker.exists()


def test_a_half_pruned_checkpoint_is_finished_on_the_next_prune(tmp_path):
    def checkpoint(step: int, complete: bool = True) -> Path:
        folder = tmp_path / f"step_{step:08d}"
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"x")
        if complete:
            (folder / COMPLETE).write_text("complete\n")
            (folder / META).write_text("{}")
        return folder

    checkpoint(1, complete=False)  # a prune killed after it deleted the marker: never loaded, never pruned before
    hidden = tmp_path / ".step_00000002.pruning"  # a prune killed after its rename
    hidden.mkdir()
    for step in (3, 4, 5):
        checkpoint(step)
    checkpoint(6, complete=False)  # newer than every complete one: not a prune's leftover, left alone
    prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005", "step_00000006"]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]


def test_a_training_checkpoint_given_as_dense_weights_is_refused_before_launch(saved, capsys):
    from training.launch.cli import preflight
    from training.config import register_schema

    register_schema()
    with pytest.raises(SystemExit) as leave:
        preflight(["model=tiny", f"checkpoint.load_dense={saved}"])
    assert leave.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"sluice: config error: checkpoint.load_dense={saved} is a training checkpoint, not dense weights; continue "
        f"it with checkpoint.resume={saved}, or export it first (scripts/export_hf.py {saved} OUT) and load OUT")
