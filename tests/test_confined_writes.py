"""Writes confined to their folder (issue 46, Why 1 and 7): an export never writes through a link, never replaces
its own source, replaces a --force folder as a whole and leaves nothing behind when the disk fails mid-write."""

import errno
import os
from pathlib import Path

import pytest

from checkpoint.atomic_write import open_append, replace_folder, write_text
from checkpoint.errors import CheckpointError
from tests.test_scripts import exported, one_line_failure, script  # noqa: F401  (exported: a module fixture)


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "VICTIM"
    path.write_text("precious")
    return path


@pytest.mark.parametrize("fmt, name", [("hf", "config.json"), ("minimind", "model.py"), ("hf", "tokenizer.json"),
                                       ("minimind", "config.json")])
def test_force_never_writes_through_a_link_inside_out(exported, tmp_path, fmt, name, capsys):
    root, _ = exported
    target, out = victim(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(target)
    argv = [str(root / "pretrain_64.pth"), str(out), "--format", fmt, "--tokenizer", str(root / "tokenizer"),
            "--force", "model=tiny"]
    assert script("export_hf").main(argv) == 0
    assert target.read_text() == "precious"
    assert not (out / name).is_symlink() and (out / name).is_file()  # the folder was replaced as a whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["VICTIM", "out"]  # no temporary sibling left


def test_a_pth_out_that_is_a_link_is_refused(exported, tmp_path, capsys):
    root, _ = exported
    target = victim(tmp_path)
    (tmp_path / "OUT.pth").symlink_to(target)
    line = one_line_failure(script("export_hf"), [str(root / "pretrain_64.pth"), str(tmp_path / "OUT.pth"),
                                                  "--format", "pth", "--force", "model=tiny"], capsys)
    assert "is a symbolic link; refusing to write through it" in line
    assert target.read_text() == "precious"


def test_a_pth_inside_a_folder_never_follows_a_link(tmp_path):
    from checkpoint.export import save_pth
    from minimind import MiniMindConfig, MiniMindForCausalLM

    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=128))
    target, out = victim(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / "pretrain_64.pth").symlink_to(target)
    with pytest.raises(CheckpointError, match="symbolic link"):
        save_pth(model, out)
    assert target.read_text() == "precious"


def test_an_out_folder_that_is_a_link_is_refused(exported, tmp_path, capsys):
    root, _ = exported
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "elsewhere")
    line = one_line_failure(script("export_hf"), [str(root / "pretrain_64.pth"), str(tmp_path / "out"), "--force",
                                                  "model=tiny"], capsys)
    assert "OUT=" in line and "is a symbolic link" in line and not any((tmp_path / "elsewhere").iterdir())


def test_out_the_source_is_one_line(exported, capsys):
    root, _ = exported
    source = str(root / "pretrain_64.pth")
    line = one_line_failure(script("export_hf"), [source, source, "--format", "pth", "--force", "model=tiny"], capsys)
    assert "is the source or holds it" in line
    line = one_line_failure(script("export_hf"), [str(root / "hf"), str(root), "--force", "model=tiny"], capsys)
    assert "is the source or holds it" in line and (root / "pretrain_64.pth").is_file()


def test_a_full_disk_leaves_nothing_behind(exported, tmp_path, monkeypatch, capsys):
    root, _ = exported

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("checkpoint.export.copy_file", full)  # config.json and the weights are written by then
    export = script("export_hf")
    argv = [str(root / "pretrain_64.pth"), str(tmp_path / "out"), "--tokenizer", str(root / "tokenizer"),
            "model=tiny"]
    capsys.readouterr()
    assert export.main(argv) == 1
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "Writing model shards" not in line]
    assert len(lines) == 1 and "the disk is full (ENOSPC)" in lines[0], lines
    assert list(tmp_path.iterdir()) == []  # no half folder: the next export is not refused as non-empty


def test_replace_folder_keeps_the_old_one_when_the_build_fails(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept").write_text("old")

    def fails(new: Path) -> None:
        (new / "half").write_text("x")
        raise OSError(errno.ENOSPC, "full")

    with pytest.raises(OSError):
        replace_folder(out, fails, "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "kept").read_text() == "old"


def test_write_text_replaces_a_link_never_its_target(tmp_path):
    target = victim(tmp_path)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(CheckpointError, match="is a symbolic link; refusing to write through it"):
        write_text(tmp_path / "link", "new", "run")
    write_text(tmp_path / "plain", "new", "run")
    assert target.read_text() == "precious" and (tmp_path / "plain").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["VICTIM", "link", "plain"]


def test_appending_never_follows_a_link(tmp_path):
    target = victim(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(target)
    with pytest.raises(CheckpointError, match="symbolic link"):
        open_append(tmp_path / "metrics.jsonl", "metrics")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CheckpointError, match="FIFO"):
        open_append(tmp_path / "fifo", "metrics")  # O_WRONLY on a FIFO without a reader: ENXIO with O_NONBLOCK
    assert target.read_text() == "precious"


def test_train_log_is_never_written_through_a_link(tmp_path, capsys):
    import logging

    from training.report.run_log import confine_log_files

    target = victim(tmp_path)
    (tmp_path / "train.log").symlink_to(target)
    root = logging.getLogger()
    hydra_like = logging.FileHandler(tmp_path / "train.log")  # what Hydra's job logging opens
    root.addHandler(hydra_like)
    try:
        with pytest.raises(SystemExit) as leave:
            confine_log_files()
    finally:
        for handler in list(root.handlers):
            if getattr(handler, "baseFilename", None) == str(tmp_path / "train.log"):
                root.removeHandler(handler)
                handler.close()
    assert leave.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice: the run's log: ") and "symbolic link" in lines[0]
    assert target.read_text() == "precious"


def test_run_files_are_written_confined(tmp_path):
    from training.report.loggers import JsonlSink
    from training.report.metrics import drop_rows_after
    from training.reliability.failures import record_failure

    target = victim(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(target)
    with pytest.raises(CheckpointError, match="symbolic link"):
        JsonlSink(tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert drop_rows_after(tmp_path / "metrics.jsonl", 1) == 1
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    (tmp_path / "failures").mkdir()
    (tmp_path / "failures" / "rank0.json").symlink_to(target)
    record_failure(tmp_path, 0, "boom", announce=False)  # refused quietly: the line is printed instead
    assert target.read_text() == "precious"


def test_generate_refuses_weights_linked_out_of_the_folder(exported, tmp_path, capsys):
    """Issue 46, Why 10: the weights a folder loads are files inside it."""
    import shutil

    root, _ = exported
    folder = tmp_path / "hf"
    shutil.copytree(root / "hf", folder)
    outside = tmp_path / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "model.safetensors").symlink_to(outside)
    line = one_line_failure(script("generate"), [str(folder), "the cat", "--max-new-tokens", "2"], capsys)
    assert "leads outside" in line and "model.safetensors" in line


def test_a_save_never_writes_through_a_link_planted_as_its_temporary_folder(tmp_path):
    from tests.test_checkpoint_ownership import train

    target = tmp_path / "victim"
    target.mkdir()
    (target / "kept").write_text("precious")
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / ".step_00000001.tmp").symlink_to(target, target_is_directory=True)
    train(tmp_path, tmp_path / "run", folder, steps=1)
    assert sorted(p.name for p in target.iterdir()) == ["kept"] and (target / "kept").read_text() == "precious"
    assert (folder / "step_00000001" / "meta.json").is_file()


def test_run_records_are_read_as_checked_files(tmp_path):
    """A FIFO or a link to a device among failures/ and hang/ is skipped, never opened (the launcher would block)."""
    from training.reliability.failures import read_failures
    from training.reliability.hang import read_dumps

    for folder, good in (("failures", '{"rank": 0, "time": 1.0, "message": "m"}'), ("hang", '{"rank": 0}')):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "rank0.json").write_text(good)
        os.mkfifo(tmp_path / folder / "rank1.json")
        (tmp_path / folder / "rank2.json").symlink_to("/dev/zero")
        (tmp_path / folder / "rank3.json").write_text('["not a record"]')
    assert [r["rank"] for r in read_failures(tmp_path)] == [0] and [d["rank"] for d in read_dumps(tmp_path)] == [0]
