"""train.eval_every: validation loss and perplexity in metrics.jsonl, at the interval and at the end, equal to the
token-weighted cross-entropy of the trained weights on the held-out batches (computed here with a plain forward)."""

import math

import pytest
import torch
import torch.nn.functional as F

from parallel.grid import ParallelGrid
from tests.equivalence import compose_run_config, run_training
from training.data import build_val_batches

RUN = ["model=tiny", "train.steps=3", "train.eval_every=2", "train.eval_batches=2", "data.val_fraction=0.1",
       "data.num_docs=400", "checkpoint.save_final=false"]


def test_validation_metrics_are_logged_at_the_interval_and_at_the_end_and_are_the_held_out_loss(tmp_path):
    from minimind import MiniMindForCausalLM
    from training.config.schema import model_config

    cfg = compose_run_config(RUN, tmp_path / "cache")
    result = run_training(cfg, ParallelGrid.single(torch.device("cpu")), tmp_path / "run")
    evaluated = {m["step"]: m for m in result["metrics"] if "val_loss" in m}
    assert sorted(evaluated) == [2, 3]
    model = MiniMindForCausalLM(model_config(cfg)).eval()
    weights = {name: tensor for name, (tensor, *_) in result["params"].items()}
    model.load_state_dict({**weights, "lm_head.weight": weights["model.embed_tokens.weight"]})
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for micro_batches in build_val_batches(cfg, 0, 1, cfg.train.eval_batches):
            for mb in micro_batches:
                logits = model(input_ids=mb.input_ids).logits
                loss_sum += F.cross_entropy(logits[:, :-1].flatten(0, 1), mb.labels[:, 1:].flatten(),
                                            ignore_index=-100, reduction="sum").item()
                tokens += int((mb.labels[:, 1:] != -100).sum())
    final = evaluated[3]
    assert final["val_loss"] == pytest.approx(loss_sum / tokens, rel=1e-6)  # the final weights, every batch
    assert final["val_ppl"] == math.exp(final["val_loss"])
    assert evaluated[2]["val_loss"] != final["val_loss"]  # step 2 evaluated the weights of step 2


def test_eval_without_a_held_out_split_is_refused_before_launch(tmp_path, capsys):
    from tests.test_config_catalogue import run_preflight
    from training.config import register_schema

    register_schema()
    code, lines = run_preflight(["model=tiny", "train.eval_every=10", f"hydra.run.dir={tmp_path}/run"], capsys)
    assert code == 2
    assert lines == ["sluice: config error: train.eval_every=10 needs a held-out split; set data.val_fraction "
                     "(e.g. 0.05) or data.val_path=<jsonl file>"]
