"""A folder is a trust boundary: every file a checkpoint, an HF folder or a dense source names stays inside it and is
a regular file; a FIFO is refused before it is opened (each FIFO case runs under a time limit, so a regression
fails instead of hanging the suite)."""

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoint.checksums import checksum_problem
from checkpoint.dense import CheckpointError, check_dense_files, read_dense_state_dict
from checkpoint.dense_source import dense_source
from checkpoint.export import export_checkpoint, read_training_weights
from checkpoint.manager import TOKENIZER, resume_problem, complete_checkpoints, find_checkpoint
from checkpoint.safe_reader import METADATA_FILE, RestrictedUnpickler
from parallel.grid import ParallelGrid
from tests.equivalence import compose_run_config, run_training
from tests.test_scripts import one_line_failure, script

TINY = ["model=tiny", "train.steps=1", "schedule.n_microbatches=1"]
OUTSIDE = "a path outside that folder"
LIMIT_S = 60  # a refusal takes milliseconds; only a call blocked on a FIFO gets near this


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A one-step training run's run directory with its final checkpoint (and the run's tokenizer in it)."""
    root = tmp_path_factory.mktemp("confine")
    cfg = compose_run_config([*TINY, "checkpoint.save_final=true"], root / "cache")
    run_training(cfg, ParallelGrid.single("cpu"), root / "run")
    return root / "run"


def copied_checkpoint(saved: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    return find_checkpoint(run)


def within_limit(call: Callable[[], object], fifos: list[Path]) -> tuple[object, BaseException | None]:
    """What `call()` returned and raised, run in a thread; one still blocked after LIMIT_S (it opened a FIFO) is
    released by opening the FIFOs for writing, and the test fails."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001  SystemExit from preflight included
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    if thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked reader sees EOF
        thread.join(LIMIT_S)
        pytest.fail(f"blocked on a FIFO ({', '.join(map(str, fifos))}) for {LIMIT_S}s instead of refusing it")
    return outcome.get("value"), outcome.get("error")


def refused(call: Callable[[], object], fifo: Path, error: type[BaseException] = CheckpointError) -> str:
    """The one-line message `call` refuses `fifo` with, in bounded time."""
    _, raised = within_limit(call, [fifo])
    assert isinstance(raised, error), raised
    message = str(raised)
    assert f"{fifo} is a FIFO, not a regular file; refusing to open it" in message and "\n" not in message, message
    return message


# --- DCP checkpoints: storage paths and .metadata -------------------------------------------------------------------

def storage_pointed_elsewhere(checkpoint: Path, how: str) -> str:
    """Rewrite the checkpoint's `.metadata` so its tensors are read from a sibling checkpoint (`step_5`), by a `../`
    or an absolute storage path, as a crafted checkpoint would; return one of the paths written."""
    other = checkpoint.with_name("step_00000005")
    shutil.copytree(checkpoint, other)
    with open(checkpoint / METADATA_FILE, "rb") as file:
        metadata = RestrictedUnpickler(file, checkpoint).load()
    for key, info in metadata.storage_data.items():
        target = f"../{other.name}/{info.relative_path}" if how == "relative" else str(other / info.relative_path)
        metadata.storage_data[key] = dataclasses.replace(info, relative_path=target)
    (checkpoint / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    reseal(checkpoint)
    return target


def reseal(checkpoint: Path) -> None:
    """Record the tampered files' sha256 where the checkpoint keeps checksums, as a crafted checkpoint would."""
    sums = checkpoint / "SHA256SUMS"
    if sums.exists():
        names = [line.partition("  ")[2] for line in sums.read_text().splitlines()]
        sums.write_text("".join(f"{hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()}  {name}\n"
                                for name in names))


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_storage_paths_outside_the_checkpoint_are_refused_on_resume_and_export(saved, tmp_path, how, capsys):
    checkpoint = copied_checkpoint(saved, tmp_path)
    target = storage_pointed_elsewhere(checkpoint, how)
    expected = f"checkpoint: {checkpoint} names {target!r}, {OUTSIDE}"
    problem = resume_problem(str(checkpoint), None, {"name": "tiny"})
    assert problem is not None and problem.startswith(expected) and "\n" not in problem, problem
    cfg = compose_run_config([*TINY, "train.steps=2", f"checkpoint.resume={checkpoint}"], tmp_path / "cache")
    with pytest.raises(CheckpointError) as error:
        run_training(cfg, ParallelGrid.single("cpu"), tmp_path / "resumed")
    assert str(error.value).startswith(expected), error.value
    with pytest.raises(CheckpointError, match=OUTSIDE):
        read_training_weights(checkpoint)
    line = one_line_failure(script("export_hf"), [str(checkpoint), str(tmp_path / "out")], capsys)
    assert line.startswith(f"export_hf: {expected}"), line
    assert not (tmp_path / "out").exists()


def test_a_fifo_as_metadata_is_refused_before_launch_and_by_export(saved, tmp_path, monkeypatch, capsys):
    """train.py's pre-launch check runs through its entry point in this process (it ends before Hydra runs)."""
    from tests.test_config_errors import train_py_here

    checkpoint = copied_checkpoint(saved, tmp_path)
    fifo = checkpoint / METADATA_FILE
    fifo.unlink()
    os.mkfifo(fifo)
    problem, _ = within_limit(lambda: resume_problem(str(checkpoint), None, {"name": "tiny"}), [fifo])
    assert problem == f"checkpoint: {fifo} is a FIFO, not a regular file; refusing to open it (replace it with the " \
        "real file)", problem
    refused(lambda: read_training_weights(checkpoint), fifo)
    out = train_py_here([*TINY, f"checkpoint.resume={checkpoint}", "logger=none",
                         f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'again'}"], monkeypatch,
                        capsys)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"sluice: config error: checkpoint: {fifo} is a FIFO, not a regular file; refusing to open it (replace it "
        "with the real file)"]
    assert not (tmp_path / "again").exists()


def test_a_fifo_as_a_tensor_file_is_refused_before_dcp_reads(saved, tmp_path):
    checkpoint = copied_checkpoint(saved, tmp_path)
    fifo = next(checkpoint.glob("*.distcp"))
    fifo.unlink()
    os.mkfifo(fifo)
    problem, _ = within_limit(lambda: resume_problem(str(checkpoint), None, {"name": "tiny"}), [fifo])
    assert problem == f"checkpoint: {fifo} is a FIFO, not a regular file; refusing to open it (replace it with the " \
        "real file)", problem
    refused(lambda: read_training_weights(checkpoint), fifo)


def test_a_fifo_as_sha256sums_is_refused_in_bounded_time(saved, tmp_path):
    checkpoint = copied_checkpoint(saved, tmp_path)
    fifo = checkpoint / "SHA256SUMS"
    fifo.unlink()
    os.mkfifo(fifo)
    refused(lambda: checksum_problem(checkpoint), fifo)  # what a resume checks before DCP reads
    refused(lambda: read_training_weights(checkpoint), fifo)


def test_a_step_link_to_another_folder_is_not_a_checkpoint_of_this_one(saved, tmp_path):
    """Resuming, pruning or taking a folder over through a `step_N` link would reach the folder it points to."""
    checkpoint = copied_checkpoint(saved, tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "step_00000009").symlink_to(checkpoint, target_is_directory=True)
    assert complete_checkpoints(mine) == [] and find_checkpoint(mine) is None
    assert complete_checkpoints(checkpoint.parent) == [checkpoint]


def test_a_meta_json_link_leaving_the_checkpoint_is_refused(saved, tmp_path):
    """Another run's meta.json (its step, data position) read through a link: refused on resume and export."""
    checkpoint = copied_checkpoint(saved, tmp_path)
    elsewhere = tmp_path / "elsewhere.json"
    (checkpoint / "meta.json").rename(elsewhere)
    (checkpoint / "meta.json").symlink_to(elsewhere)
    expected = (f"checkpoint: {checkpoint / 'meta.json'} leads outside {checkpoint} (to {elsewhere}); a folder's files "
                "must sit inside it (replace the link with the file itself)")
    assert resume_problem(str(checkpoint), None, {"name": "tiny"}) == expected
    with pytest.raises(CheckpointError) as error:  # checksums may name the link first: refused either way
        read_training_weights(checkpoint)
    assert f"{checkpoint / 'meta.json'} leads outside {checkpoint}" in str(error.value) and "\n" not in str(error.value)


# --- export: the tokenizer folder of a checkpoint ------------------------------------------------------------------

def test_a_tokenizer_symlink_leaving_the_checkpoint_is_refused_and_nothing_is_exported(saved, tmp_path, capsys):
    checkpoint = copied_checkpoint(saved, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for export")
    link = checkpoint / TOKENIZER / "tokenizer_config.json"
    assert link.is_file()  # the run saved its tokenizer: the link replaces a real file
    link.unlink()
    link.symlink_to(secret)
    out = tmp_path / "out"
    line = one_line_failure(script("export_hf"), [str(checkpoint), str(out)], capsys)
    assert line == (f"export_hf: checkpoint tokenizer: {link} leads outside {checkpoint} (to {secret}); a folder's "
                    "files must sit inside it (replace the link with the file itself)"), line
    assert not out.exists()
    (checkpoint / TOKENIZER).rename(tmp_path / "elsewhere")  # the whole folder a link out: refused the same way
    (checkpoint / TOKENIZER).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match=f"checkpoint tokenizer: .* leads outside {checkpoint}"):
        export_checkpoint(checkpoint, out)
    assert not out.exists()


def test_a_tokenizer_symlink_inside_the_folder_is_exported(saved, tmp_path):
    checkpoint = copied_checkpoint(saved, tmp_path)
    folder = checkpoint / TOKENIZER
    # What the export writes of the file itself (rewritten where transformers 4.x reads it otherwise, issue 48).
    original = (export_checkpoint(checkpoint, tmp_path / "plain") / "tokenizer_config.json").read_bytes()
    (folder / "tokenizer_config.json").rename(folder / "shared_config.json")
    (folder / "tokenizer_config.json").symlink_to("shared_config.json")
    out = export_checkpoint(checkpoint, tmp_path / "out")
    copied = out / "tokenizer_config.json"
    assert not copied.is_symlink() and copied.read_bytes() == original
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


# --- dense sources: a file, an HF folder and its index -------------------------------------------------------------

def hf_folder(tmp_path: Path, shard: str) -> Path:
    """An HF folder whose safetensors index names `shard` for its one weight `w`."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard}}))
    return folder


def dense_reads(path: Path) -> list[Callable[[], object]]:
    """Every way a run, preflight or export reads dense weights at `path`."""
    return [lambda: check_dense_files(path), lambda: read_dense_state_dict(path),
            lambda: dense_source(path, {"w": (2,)}, {})]


def test_a_fifo_as_the_load_dense_file_is_refused_in_bounded_time(tmp_path, data_cache, capsys):
    fifo = tmp_path / "weights.safetensors"
    os.mkfifo(fifo)
    for read in dense_reads(fifo):
        assert refused(read, fifo).startswith(f"checkpoint.load_dense: {fifo} is a FIFO")
    from training.launch.cli import preflight
    from training.config import register_schema

    register_schema()
    capsys.readouterr()
    _, leave = within_limit(lambda: preflight([*TINY, f"checkpoint.load_dense={fifo}",
                                               f"data.cache_dir={data_cache}"]), [fifo])
    assert isinstance(leave, SystemExit) and leave.code == 2, leave
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"sluice: config error: checkpoint.load_dense: {fifo} is a FIFO, not a regular file; refusing to open it "
        "(replace it with the real file)")


def test_a_fifo_as_a_shard_named_by_an_index_is_refused_in_bounded_time(tmp_path):
    folder = hf_folder(tmp_path, "model-00001-of-00001.safetensors")
    fifo = folder / "model-00001-of-00001.safetensors"
    os.mkfifo(fifo)
    for read in dense_reads(folder):
        refused(read, fifo)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "config.json"])
def test_a_fifo_beside_the_weights_is_refused_before_launch(tmp_path, data_cache, name, capsys):
    """The weights' tokenizer check opens the folder's tokenizer (and config.json) before launch."""
    from training.launch.cli import preflight
    from training.config import register_schema
    from training.data import synthetic_corpus, train_bpe_tokenizer

    folder = tmp_path / "hf"
    train_bpe_tokenizer(synthetic_corpus(50, seed=0), vocab_size=300).save_pretrained(folder)
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    register_schema()
    capsys.readouterr()
    _, leave = within_limit(lambda: preflight([*TINY, f"checkpoint.load_dense={folder}",
                                               f"data.cache_dir={data_cache}"]), [folder / name])
    assert isinstance(leave, SystemExit) and leave.code == 2, leave
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"sluice: config error: checkpoint.load_dense: {folder / name} is a FIFO, not a regular file; refusing to "
        "open it (replace it with the real file)")


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_an_index_naming_a_shard_outside_its_folder_is_refused(tmp_path, how):
    outside = tmp_path / "outside.safetensors"
    save_file({"w": torch.ones(2)}, outside)  # a real shard: before the check it loaded
    name = {"relative": "../outside.safetensors", "absolute": str(outside), "symlink": "linked.safetensors"}[how]
    folder = hf_folder(tmp_path, name)
    if how == "symlink":
        (folder / name).symlink_to(outside)
    expected = f"checkpoint.load_dense: {folder / name} leads outside {folder}" if how == "symlink" else \
        f"checkpoint.load_dense: {folder} names {name!r}, {OUTSIDE}"
    for read in dense_reads(folder):
        with pytest.raises(CheckpointError) as error:
            read()
        assert str(error.value).startswith(expected) and "\n" not in str(error.value), error.value


def test_an_hf_folder_with_its_shards_inside_still_loads(tmp_path):
    folder = hf_folder(tmp_path, "shards/model-00001.safetensors")
    (folder / "shards").mkdir()
    save_file({"w": torch.arange(2.0)}, folder / "shards" / "model-00001.safetensors")
    check_dense_files(folder)
    assert torch.equal(read_dense_state_dict(folder)["w"], torch.arange(2.0))
    assert torch.equal(dense_source(folder, {"w": (2,)}, {})("w", (2,)), torch.arange(2.0))


def test_a_dense_export_refuses_a_tokenizer_link_leaving_its_folder(saved, tmp_path, capsys):
    """`export_hf.py DENSE OUT --tokenizer DIR`: DIR is the boundary of the tokenizer files copied."""
    from checkpoint.export import export_checkpoint as export

    weights = export(find_checkpoint(saved), tmp_path / "weights.pth", fmt="pth")
    tokenizer = tmp_path / "tok"
    shutil.copytree(find_checkpoint(saved) / TOKENIZER, tokenizer)
    (tmp_path / "secret.json").write_text("{}")
    (tokenizer / "special_tokens_map.json").unlink(missing_ok=True)
    (tokenizer / "special_tokens_map.json").symlink_to(tmp_path / "secret.json")
    out = tmp_path / "out"
    line = one_line_failure(script("export_hf"), [str(weights), str(out), "--tokenizer", str(tokenizer), "model=tiny"],
                            capsys)
    assert line == (f"export_hf: tokenizer: {tokenizer / 'special_tokens_map.json'} leads outside {tokenizer} (to "
                    f"{tmp_path / 'secret.json'}); a folder's files must sit inside it (replace the link with the file "
                    "itself)"), line
    assert not out.exists()
