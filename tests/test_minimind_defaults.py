"""What the docs say MiniMind's trainers use is what they use (issue 38: `lora=minimind` said rank 8 where MiniMind's
train_lora calls `apply_lora(model, rank=16)`, and `dpo.beta`'s help called 0.1 MiniMind's default where its
train_dpo.py passes 0.15): the preset's values, and each key's help naming MiniMind's figure."""

import pytest
from omegaconf import OmegaConf

from training.config.schema import compose_config, schema_keys

MEANINGS = {key.name: key.meaning for key in schema_keys()}
DEFAULTS = compose_config([])


def test_lora_minimind_is_minimind_trainers_rank_16_scale_1_on_square_linears():
    lora = compose_config(["lora=minimind"]).lora
    assert (lora.rank, lora.alpha, lora.targets, lora.dropout) == (16, None, None, 0.0)


@pytest.mark.parametrize("key, default, minimind", [
    ("dpo.beta", 0.1, "MiniMind's train_dpo.py passes 0.15"),
    ("distill.alpha", 0.5, "MiniMind's train_distillation.py: 0.5"),
    ("distill.temperature", 1.5, "MiniMind's default 1.5"),
    ("lora.alpha", None, "scale 1, as MiniMind's train_lora"),
])
def test_a_keys_help_states_minimind_s_value(key, default, minimind):
    assert OmegaConf.select(DEFAULTS, key) == default
    assert minimind in MEANINGS[key]
