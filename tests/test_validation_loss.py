"""train.eval_every: validation loss and perplexity in metrics.jsonl, at the interval and at the end."""

import json
import math
import subprocess
import sys

from tests.conftest import ROOT


def test_validation_metrics_are_logged_at_the_interval_and_at_the_end(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "train.py", "model=tiny", "train.steps=3", "train.eval_every=2",
                          "train.eval_batches=2", "data.val_fraction=0.1", "train.seq_len=32",
                          "train.micro_batch_size=2", "schedule.n_microbatches=2", "data.num_docs=400",
                          "logger=none", f"data.cache_dir={tmp_path}/cache", f"hydra.run.dir={run}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r for r in records if "val_loss" in r}
    assert sorted(evaluated) == [2, 3]
    for record in evaluated.values():
        assert 0 < record["val_loss"] < 20 and record["val_ppl"] == math.exp(record["val_loss"])


def test_eval_without_a_held_out_split_is_refused_before_launch(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "model=tiny", "train.eval_every=10",
                          f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "sluice: config error: train.eval_every=10 needs a held-out split; set data.val_fraction (e.g. 0.05) "
        "or data.val_path=<jsonl file>"]
