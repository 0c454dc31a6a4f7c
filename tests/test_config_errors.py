"""Every bad config gets exit code 2 and one readable line naming the key and the fix, before any work."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

BAD_CONFIGS = [
    (["model=nope"], "model=nope: no such preset"),
    (["schedule=zigzag"], "schedule=zigzag: no such preset"),
    (["train.steps=0"], "train.steps=0 must be positive"),
    (["train.micro_batch_size=-2"], "train.micro_batch_size=-2"),
    (["model=tiny", "train.seq_len=4096"], "train.seq_len=4096 exceeds model.max_position_embeddings"),
    (["train.dtype=fp8"], "train.dtype=fp8 is not supported"),
    (["data=jsonl"], "data.path: not set; pass data.path="),
    (["data=jsonl", "data.path=no/such/file.jsonl", "data.tokenizer=no/such/dir"], "data.path"),
    (["model=tiny", "model.vocab_size=100"], "model.vocab_size=100"),
    (["train.stepz=3"], "train.stepz"),
    (["train.steps=many"], "train.steps"),
    (["model=tiny", "model.num_key_value_heads=3"], "model.num_key_value_heads=3"),
    (["optim.lr=0"], "optim.lr=0.0 must be positive"),
    (["schedule.n_microbatches=0"], "schedule.n_microbatches=0 must be positive"),
    (["parallel.tp=0"], "parallel.tp=0 must be positive"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2"),
    (["logger=nope"], "logger=nope: no such preset"),
    (["model=tiny", "parallel.tp=3"], "parallel.tp=3 does not divide num_attention_heads=4; choose tp in {1, 2}"),
    (["model=tiny", "parallel.pp=5"], "5 stages but the model has 4 layers; use at most 4 stages"),
    (["model=tiny", "parallel.pp=3", "parallel.layers_per_stage=[1,3,1]"], "sums to 5 but the model has 4 layers"),
    (["model=tiny", "parallel.pp=2", "parallel.layers_per_stage=[4,0]"], "parallel.layers_per_stage[1] = 0"),
    (["model=tiny", "parallel.pp=2", "schedule.n_microbatches=0"], "schedule.n_microbatches=0 must be positive"),
    (["checkpoint.load_dense=no/such.pth"], "checkpoint.load_dense=no/such.pth does not exist"),
    (["checkpoint.every=100"], "checkpoint.every: training checkpoints are not implemented yet"),
    (["data.format=zip"], "data.format: unknown format 'zip'; use data.format=packed or data.format=padded"),
]


def run_train(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, expected", BAD_CONFIGS, ids=[" ".join(a) for a, _ in BAD_CONFIGS])
def test_bad_config_exits_2_with_one_line(args, expected):
    result = run_train(args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sluice: config error: ")
    assert expected in lines[0]


def test_bad_job_in_a_sweep_is_caught_before_any_job_runs(tmp_path):
    result = run_train(["-m", "train.steps=1,0", f"hydra.sweep.dir={tmp_path}/sweep"])
    assert result.returncode == 2
    assert "train.steps=0 must be positive" in result.stderr
    assert not (tmp_path / "sweep").exists()
