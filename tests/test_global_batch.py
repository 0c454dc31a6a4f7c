"""train.global_batch_size: the global batch fixes n_microbatches through dp and micro_batch_size."""

import pytest

from tests.equivalence import compose_run_config
from training.config import ConfigError
from training.config.validate import validate


def resolved(tmp_path, *overrides: str, world_size: int | None = None) -> int:
    cfg = compose_run_config(["model=tiny", *overrides], tmp_path)
    validate(cfg, world_size)
    return cfg.schedule.n_microbatches


def test_global_batch_sets_n_microbatches(tmp_path):
    assert resolved(tmp_path, "train.micro_batch_size=2", "schedule.n_microbatches=3") == 3  # unset: as written
    assert resolved(tmp_path, "train.micro_batch_size=2", "train.global_batch_size=16") == 8
    assert resolved(tmp_path, "parallel.dp=2", "train.micro_batch_size=2", "train.global_batch_size=16") == 4
    # dp left to the launcher: world size 4 at pp=2 leaves dp=2
    assert resolved(tmp_path, "parallel.pp=2", "train.micro_batch_size=2", "train.global_batch_size=16",
                    world_size=4) == 4


def test_global_batch_that_does_not_divide_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^train.global_batch_size=12 is not a multiple of dp 2 x "
                                          r"train.micro_batch_size 4 = 8; change one of them$"):
        resolved(tmp_path, "parallel.dp=2", "train.micro_batch_size=4", "train.global_batch_size=12")
