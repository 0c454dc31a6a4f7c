"""End to end through `python train.py`: run directory, metrics, TensorBoard, MiniMind JSONL data."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from training.data import synthetic_corpus, train_bpe_tokenizer

TINY = ["model=tiny", "train.seq_len=32", "train.micro_batch_size=4", "schedule.n_microbatches=2",
        "data.num_docs=300", "train.log_every=1"]
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}


def train(tmp_path, *args: str) -> list[dict]:
    """Run train.py into tmp_path/run and return its metrics records."""
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "train.py", *TINY, f"data.cache_dir={tmp_path}/cache",
                             f"hydra.run.dir={run_dir}", *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_writes_metrics_tensorboard_and_config(tmp_path):
    records = train(tmp_path, "train.steps=40", "optim.lr=3e-3", "optim.warmup_steps=5")
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all(METRIC_KEYS <= set(r) for r in records)
    assert records[-1]["loss"] < 0.8 * records[0]["loss"]  # the synthetic corpus is learnable
    run_dir = tmp_path / "run"
    assert any((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert (run_dir / "train.log").exists()


def test_same_seed_same_losses(tmp_path):
    first = train(tmp_path / "a", "train.steps=3", "logger=none")
    second = train(tmp_path / "b", "train.steps=3", "logger=none")
    assert [r["loss"] for r in first] == [r["loss"] for r in second]


@pytest.mark.parametrize("fmt", ["padded", "packed"])
def test_minimind_jsonl_with_local_tokenizer_folder(tmp_path, fmt):
    texts = synthetic_corpus(200, seed=3)
    data = tmp_path / "pretrain.jsonl"
    data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    tokenizer_dir = tmp_path / "tokenizer"
    train_bpe_tokenizer(texts, vocab_size=512).save_pretrained(tokenizer_dir)
    records = train(tmp_path, "data=jsonl", f"data.path={data}", f"data.tokenizer={tokenizer_dir}",
                    f"data.format={fmt}", "train.steps=3", "logger=none")
    assert len(records) == 3 and all(r["loss"] > 0 for r in records)


def test_wandb_offline_logger(tmp_path):
    train(tmp_path, "train.steps=2", "logger=wandb")
    assert any((tmp_path / "run" / "wandb").glob("offline-run-*"))
