"""The planner's benchmark scripts: their layouts are valid and hold one global batch; the rank correlation."""

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from predict_step import LAYOUTS, SHAPE, config, spearman  # noqa: E402


def test_spearman():
    assert spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == 1.0
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == -1.0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_is_valid_at_one_global_batch(name, tmp_path):
    cfg = config([*LAYOUTS[name], f"data.cache_dir={tmp_path}"], base=SHAPE)
    assert cfg.model.vocab_size == 6400 and cfg.model.num_hidden_layers == 8
    assert (cfg.parallel.dp or 1) * cfg.schedule.n_microbatches * cfg.train.micro_batch_size == 32
    assert (cfg.parallel.dp or 1) * cfg.parallel.tp * cfg.parallel.pp == 2
