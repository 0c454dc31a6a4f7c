"""Sizes tensor parallelism splits, under transformers' config field names (shared by every family's adapter)."""

from __future__ import annotations


def tp_sizes(config, moe: bool) -> dict[str, int]:
    """Heads, key/value heads, the MLP width (and the experts' with MoE) and the vocabulary, by config key."""
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size}
    if moe:
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    return {**sizes, "vocab_size": config.vocab_size}
