"""End to end: `python train.py` writes its run directory (metrics, TensorBoard, wandb, config) and learns; the same
seed gives the same losses and another seed other ones (dropout included); MiniMind JSONL data with a local
tokenizer folder reaches the model token for token."""

import json
import math
import subprocess
import sys

import pytest
import torch

from parallel.grid import ParallelGrid
from tests.conftest import ROOT
from tests.equivalence import compose_run_config, run_training
from training.data import build_data, synthetic_corpus, train_bpe_tokenizer

TINY = ["model=tiny", "train.seq_len=32", "train.micro_batch_size=4", "schedule.n_microbatches=2",
        "data.num_docs=300", "train.log_every=1"]
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tokens"}


def test_training_writes_metrics_tensorboard_wandb_and_config_and_learns(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "train.py", *TINY, f"data.cache_dir={data_cache}",
                             f"hydra.run.dir={run_dir}", "train.steps=40", "optim.lr=3e-3", "optim.warmup_steps=5",
                             "logger.backends=[tensorboard,wandb]"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all(METRIC_KEYS <= set(r) for r in records)
    assert records[-1]["loss"] < 0.8 * records[0]["loss"]  # the synthetic corpus is learnable
    assert any((run_dir / "tb").glob("events.out.tfevents.*"))
    assert any((run_dir / "wandb").glob("offline-run-*"))
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert (run_dir / "train.log").exists()


def test_same_seed_same_losses_other_seed_other_losses(tmp_path):
    """train.seed decides the weights and (with dropout) every mask, whatever ran in this process before."""
    def losses(name: str, seed: int) -> list[float]:
        cfg = compose_run_config([*TINY, "train.steps=3", "model.dropout=0.1", f"train.seed={seed}",
                                  "checkpoint.save_final=false"], tmp_path / "cache")
        return run_training(cfg, ParallelGrid.single(torch.device("cpu")), tmp_path / name)["losses"]

    first = losses("a", 3)
    torch.rand(1000)  # the process's RNG moves on: the next run must not depend on it
    assert losses("b", 3) == first
    assert losses("c", 4) != first


@pytest.mark.parametrize("fmt", ["padded", "packed"])
def test_minimind_jsonl_with_local_tokenizer_folder(tmp_path, fmt):
    texts = synthetic_corpus(200, seed=3)
    data = tmp_path / "pretrain.jsonl"
    data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = train_bpe_tokenizer(texts, vocab_size=512)
    tokenizer.save_pretrained(tokenizer_dir)
    cfg = compose_run_config([*TINY, "data=jsonl", f"data.path={data}", f"data.tokenizer={tokenizer_dir}",
                              f"data.format={fmt}", "train.steps=3", "checkpoint.save_final=false",
                              *(["train.seq_len=128"] if fmt == "padded" else [])], tmp_path / "cache")
    records = run_training(cfg, ParallelGrid.single(torch.device("cpu")), tmp_path / "run")["metrics"]
    stream = build_data(cfg, 0, 1, verbose=False)[0]
    for step, record in enumerate(records):
        micro_batches = stream.batch(step)
        assert record["tokens"] == sum(mb.num_label_tokens() for mb in micro_batches)
        assert all(int(mb.input_ids.max()) < len(tokenizer) for mb in micro_batches)  # the folder's tokenizer
    # A fresh model predicts near-uniformly over its 2048-token vocabulary: ln 2048 = 7.62.
    assert abs(records[0]["loss"] - math.log(2048)) < 0.3, records[0]
    full = cfg.schedule.n_microbatches * cfg.train.micro_batch_size * (cfg.train.seq_len - 1)
    assert (records[0]["tokens"] == full) == (fmt == "packed")  # one document per padded sample: label-free tails
    text = tokenizer.decode(stream.batch(0)[0].input_ids[0])
    assert any(word in " ".join(texts) for word in text.split()[:3])
