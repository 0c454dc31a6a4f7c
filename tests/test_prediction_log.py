"""After a traced step the trainer records the cost model's predicted step time and peak memory next to the
measured ones (None where no costs are cached for the shape)."""

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest

from tests.equivalence import compose_run_config, layouts_worker
from tests.spawn import run_workers
from tests.test_layout_search_predict import fake_costs
from training.layout_search.costs import cost_key, save
from training.layout_search.profile import run_setting
from training.layout_search.report import prediction_record

PP2 = ["model=tiny", "parallel.pp=2", "train.steps=2", "train.trace_step=2", "train.log_every=5"]


def cache_fake_costs(cfg, world_size: int) -> None:
    """Round-number costs in the cache, under the key a run of `cfg` on `world_size` processes looks up."""
    device, dtype, backend, threads = run_setting(cfg, world_size)
    key = cost_key(cfg, device.type, str(dtype).removeprefix("torch."), backend, threads)
    save(cfg, dataclasses.replace(fake_costs(), key=key))


def test_prediction_record_logs_predicted_against_measured(tmp_path, caplog):
    cfg = compose_run_config(PP2, tmp_path)
    grid = SimpleNamespace(world_size=2, rank=0, dp=1)
    measured = {"step_time_s": 0.5, "peak_mem_bytes": 300 << 20}
    assert prediction_record(cfg, grid, measured) == {"predicted_step_s": None, "predicted_peak_mem_bytes": None}
    cache_fake_costs(cfg, 2)
    with caplog.at_level(logging.INFO, logger="sluice"):
        got = prediction_record(cfg, grid, measured)
    # tiny: 4 layers -> 2 per stage; 1F1B over 4 micro-batches of F=1 B=2 s per layer: 2 x 3 x (4 + 1) s.
    assert got["predicted_step_s"] == pytest.approx(30.0) and got["predicted_peak_mem_bytes"] > 0
    assert "predicted step 30.000 s vs measured 0.500 s; peak memory predicted" in caplog.text
    assert "vs measured 300.0 MiB" in caplog.text


def test_traced_step_metrics_hold_the_prediction_keys(tmp_path):
    cached, bare = tmp_path / "cached", tmp_path / "bare"
    cache_fake_costs(compose_run_config(PP2, cached), 2)
    runs = [([*PP2, f"data.cache_dir={folder}"], str(tmp_path / f"run_{folder.name}")) for folder in (cached, bare)]
    run_workers(layouts_worker, 2, runs, str(cached), timeout=240)
    for folder, expect_numbers in ((cached, True), (bare, False)):
        records = [json.loads(line) for line in (tmp_path / f"run_{folder.name}" / "metrics.jsonl").open()]
        traced = [r for r in records if "predicted_step_s" in r]
        assert [r["step"] for r in traced] == [2] and "predicted_peak_mem_bytes" in traced[0]
        assert (traced[0]["predicted_step_s"] is not None) == expect_numbers
        assert traced[0]["step_time_s"] > 0 and traced[0]["peak_mem_bytes"] > 0
