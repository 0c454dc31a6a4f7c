"""parallel.layers_per_stage=auto: the cost-balanced split, from FLOPs or from cached measurements."""

import dataclasses
import logging

import pytest

from parallel.pipeline.partition import PartitionError, balanced_partition
from tests.equivalence import compose_run_config
from tests.test_layout_search_predict import fake_costs
from training.config.validate import validate
from training.layout_search.balance import cost_balanced_partition, flop_weights
from training.layout_search.costs import save
from training.layout_search.profile import run_setting
from training.layout_search.costs import cost_key

SMALL_32K = ["model.num_hidden_layers=8", "model.hidden_size=256", "model.num_attention_heads=4",
             "model.num_key_value_heads=2", "model.vocab_size=32000", "train.seq_len=128", "train.micro_batch_size=4",
             "train.dtype=fp32", "parallel.pp=2", "parallel.layers_per_stage=auto"]


def test_balanced_partition_minimises_the_costliest_stage():
    assert balanced_partition(8, 2, 1.0) == [4, 4]
    assert balanced_partition(8, 2, 1.0, first=0.1, last=2.5) == [5, 3]
    assert balanced_partition(8, 4, 1.0, first=0.2, last=3.0) == [2, 3, 2, 1]
    assert balanced_partition(4, 4, 1.0, first=5.0, last=5.0) == [1, 1, 1, 1]  # at least one layer each
    assert cost_balanced_partition(8, 1, 1.0, 9.0) == (8,)
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4 stages"):
        balanced_partition(3, 4, 1.0)


def test_auto_with_a_32k_vocabulary_puts_fewer_layers_on_the_last_stage(tmp_path, caplog):
    cfg = compose_run_config(SMALL_32K, tmp_path)
    embed, head = flop_weights(cfg)
    assert embed == 0 and head > 4  # the 32k-vocabulary head costs more than four layers
    with caplog.at_level(logging.INFO, logger="sluice"):
        validate(cfg)
    chosen = list(cfg.parallel.layers_per_stage)
    assert sum(chosen) == 8 and chosen[-1] < 4
    assert f"layers_per_stage=auto chose {chosen} (stage costs" in caplog.text and "FLOP estimate" in caplog.text


def test_auto_prefers_cached_measurements(tmp_path, caplog):
    cfg = compose_run_config(SMALL_32K, tmp_path)
    device, dtype, backend, threads = run_setting(cfg)
    key = cost_key(cfg, device.type, str(dtype).removeprefix("torch."), backend, threads)
    # A measured head as cheap as one layer (F+B = 3 s each): the even split wins.
    save(cfg, dataclasses.replace(fake_costs(head_f=1.0, head_b=2.0), key=key))
    with caplog.at_level(logging.INFO, logger="sluice"):
        validate(cfg)
    assert list(cfg.parallel.layers_per_stage) == [4, 4]
    assert "stage costs 4.00, 5.00 layer units, measured" in caplog.text
