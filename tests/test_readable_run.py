"""A run read from a file (Slurm, `> log`): no tqdm carriage returns, one plain line per logged step, tokens_per_s
counting label tokens with all positions (padding included) apart, hints naming the interpreter actually used; and
the small frictions of a MiniMind user: MiniMind's argument names suggest Sluice's keys, a truncated JSONL line is
named at the column where it ends."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from training.config.unknown_keys import unknown_key
from training.data.jsonl import parse_row
from training.data.rows import TASKS


def test_a_redirected_run_has_no_bar_and_counts_label_tokens(tmp_path, data_cache):
    log = tmp_path / "out.txt"
    args = [sys.executable, "train.py", "model=tiny", "train.task=sft", "train.steps=2", "train.seq_len=64",
            "train.micro_batch_size=2", "schedule.n_microbatches=1", "data.num_docs=300", "logger=none",
            "train.log_every=1", f"data.cache_dir={data_cache}", f"hydra.run.dir={tmp_path / 'run'}"]
    with open(log, "wb") as out:
        done = subprocess.run(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=300,
                              stdin=subprocess.DEVNULL)
    text = log.read_bytes()
    assert done.returncode == 0, text[-2000:]
    assert b"\r" not in text
    lines = text.decode().splitlines()
    assert sum(" - step " in line for line in lines) == 2  # one plain line per logged step
    python = os.path.relpath(sys.executable, ROOT) if Path(sys.executable).is_relative_to(ROOT) else sys.executable
    assert any(line.endswith(f"  export:   {python} scripts/export_hf.py {tmp_path / 'run' / 'checkpoints'} "
                             "<out folder>") for line in lines), lines[-6:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # SFT pads each conversation: the label tokens are a part of the positions computed
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["step_time_s"], rel=1e-6)
        assert row["padded_tokens_per_s"] == pytest.approx(2 * 64 / row["step_time_s"], rel=1e-6)
        assert row["tokens_per_s"] < row["padded_tokens_per_s"]


@pytest.mark.parametrize("key, suggestion", [
    ("data.data_path", "data.path"), ("data_path", "data.path"), ("max_seq_len", "train.seq_len"),
    ("batch_size", "train.micro_batch_size"), ("learning_rate", "optim.lr"), ("accumulation_steps",
                                                                            "schedule.n_microbatches"),
    ("from_weight", "checkpoint.load_dense"), ("epochs", "train.steps")])
def test_minimind_argument_names_suggest_the_key(key, suggestion):
    assert f"did you mean {suggestion}?" in str(unknown_key(key))


def test_a_truncated_line_is_named_where_it_ends():
    line = b'{"text": "a line that a full disk cut off in the middle of its'
    assert parse_row(line, TASKS["text"]) == (None, f"line is not JSON: it ends at column {len(line) + 1} before its "
                                                    "value is complete, in a string opened at column 10 (a truncated "
                                                    "line?)")
    assert parse_row(b'{"text": "abc"', TASKS["text"])[1].startswith("line is not JSON: it ends at column 15")
    assert parse_row(b'{"text": "abc" x}', TASKS["text"])[1] == "line is not JSON (Expecting ',' delimiter at column 16)"


def test_the_documented_continue_commands_match_the_run_they_continue():
    """docs/checkpoints.md continues README's `experiment=demo` run: the same model, or the resume is refused (exit 2)."""
    import shlex

    from models import config_record
    from training.config.schema import compose_config, model_config

    demo = config_record(model_config(compose_config(["experiment=demo"])))
    lines = [line for line in (ROOT / "docs" / "checkpoints.md").read_text().splitlines()
             if line.startswith(".venv/bin/python train.py") and "checkpoint.resume=" in line and "runs/demo" in line]
    assert len(lines) >= 2
    for line in lines:
        words = shlex.split(line.split("  #")[0])[2:]
        kept = [w for w in words if not w.startswith(("checkpoint.resume=", "hydra.run.dir=", "train.steps="))]
        assert config_record(model_config(compose_config(kept))) == demo, line
