"""Acceptance 2 at test size: predicted peak memory per pipeline rank within 20% of what a step holds, for
pp=2 1F1B, GPipe and ZB-H1 with recompute none and full (scripts/bench/memory_model.py at full size)."""

import sys

import torch

from tests.conftest import ROOT
from training.layout_search.costs import Fit, MeasuredCosts
from training.layout_search.profile import measure_compute

sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from memory_model import LAYOUTS, compare, config  # noqa: E402

SHAPE = ["model=tiny", "train.seq_len=64", "train.micro_batch_size=2", "train.dtype=fp32", "parallel.pp=2",
         "schedule.n_microbatches=4", "logger=none"]


def test_predicted_peak_memory_per_rank_is_within_20_percent(tmp_path):
    base = [*SHAPE, f"data.cache_dir={tmp_path}"]
    cfg = config(base)
    costs = MeasuredCosts(key={"micro_batch_size": 2, "backend": "gloo"}, p2p=Fit(0, 0), allreduce=Fit(0, 0),
                          **measure_compute(cfg, torch.device("cpu"), torch.float32))
    rows = compare(base, lambda cfg: costs)
    assert [(s, m) for s, m, _, _ in rows] == LAYOUTS
    for schedule, mode, predicted, measured in rows:
        assert len(predicted) == len(measured) == 2
        for p, m in zip(predicted, measured):
            assert abs(p / m - 1) <= 0.2, (schedule, mode, predicted, measured)
    peaks = {(s, m): max(measured) for s, m, _, measured in rows}
    assert peaks["gpipe", "none"] > peaks["1f1b", "none"] > peaks["1f1b", "full"]  # the memory is really there
