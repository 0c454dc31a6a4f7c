"""ZeRO-1 (optimizer state sharded over DP) trains with the numbers of one process."""

import pytest

from tests.equivalence import assert_equivalent, baseline, layout_worker
from tests.spawn import run_workers

STEPS = ["model=tiny", "train.steps=3", "schedule.n_microbatches=2", "optim.warmup_steps=0"]


@pytest.mark.parametrize("layout", [["parallel.pp=2"], ["parallel.tp=2"]], ids=["dp2-pp2", "dp2-tp2"])
def test_zero1_equals_one_process(tmp_path, layout):
    overrides = [*STEPS, "parallel.dp=2", "parallel.zero=1", *layout]
    results = run_workers(layout_worker, 4, overrides, str(tmp_path / "cache"), str(tmp_path / "run"), timeout=300)
    reference = baseline([*STEPS], tmp_path / "cache", tmp_path / "baseline", dp=2)
    assert_equivalent(results, reference)
