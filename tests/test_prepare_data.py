"""scripts/prepare_data.py: builds the token cache that training then reads; bad data is one line, exit 2."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest

from tests.conftest import ROOT
from tests.data_helpers import SMALL, data_section, make_cfg, spec, write_jsonl
from training.data import build_data, build_tokenizer, synthetic_corpus


@pytest.fixture
def prepare(capsys):
    """`python scripts/prepare_data.py overrides` through its main(argv) in this process (a Python start-up fewer):
    exit code, stdout and stderr."""
    spec_ = importlib.util.spec_from_file_location("prepare_data_script", ROOT / "scripts" / "prepare_data.py")
    script = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(script)

    def run(*overrides: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            script.main(list(overrides))
            code = 0
        except SystemExit as leave:
            code = leave.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(overrides, code, out.out, out.err)

    return run


def test_prepare_then_train_reads_the_cache(tmp_path, prepare):
    tokenizer = tmp_path / "tokenizer"
    build_tokenizer(spec(**SMALL, cache_dir=str(tmp_path / "c0"))).save_pretrained(tokenizer)
    path = write_jsonl(tmp_path / "docs.jsonl", synthetic_corpus(60, seed=4))
    cache = tmp_path / "cache"
    result = prepare("data=jsonl", f"data.path={path}", f"data.tokenizer={tokenizer}", f"data.cache_dir={cache}",
                     "data.format=packed", "data.val_fraction=0.1", "train.seq_len=32")
    assert result.returncode == 0, result.stderr[-2000:]
    folder = result.stdout.splitlines()[0].split("cache ", 1)[1]
    assert json.loads((tmp_path / folder / "meta.json").read_text())["n_docs"] == 60
    assert "held out" in result.stdout and "0 bad lines skipped" in result.stdout
    mtime = (tmp_path / folder / "tokens.bin").stat().st_mtime_ns
    cfg = make_cfg(data_section(name="jsonl", path=str(path), tokenizer=str(tokenizer), cache_dir=str(cache),
                                format="packed", val_fraction=0.1))
    stream, _ = build_data(cfg, 0, 1)
    assert str(stream.samples.docs.tokens.filename).startswith(str(tmp_path / folder))
    assert (tmp_path / folder / "tokens.bin").stat().st_mtime_ns == mtime


def test_prepare_reports_bad_data_in_one_line(tmp_path, prepare):
    tokenizer = tmp_path / "tokenizer"
    build_tokenizer(spec(**SMALL, cache_dir=str(tmp_path / "c0"))).save_pretrained(tokenizer)
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": null}\n')
    result = prepare("data=jsonl", f"data.path={path}", f"data.tokenizer={tokenizer}",
                     f"data.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"sluice: data error: data.path: {path}:2: \"text\" is null; fix or remove "
                                      "the line, or set data.skip_bad_lines=true to skip bad lines")
