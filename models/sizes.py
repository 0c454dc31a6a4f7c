"""Sizes tensor parallelism splits, under transformers' config field names (shared by every family's adapter)."""

from __future__ import annotations

ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj")  # projections whose output rows are heads
BY_HEADS = ("colwise", "packed_colwise")  # their output stays split: each rank computes attention on its own heads


def tp_sizes(config, moe: bool, plan: dict[str, str] | None = None) -> dict[str, int]:
    """Heads, key/value heads, the MLP width (and the experts' with MoE) and the vocabulary, by config key.

    With the `plan` a family runs: where its attention projections are gathered (OLMo2's `colwise_gather_output`)
    every rank computes every head, so tp need divide only the projections' widths, not the head counts."""
    attention = {style for key, style in (plan or {}).items() if key.rsplit(".", 1)[-1] in ATTENTION}
    if plan is None or attention & set(BY_HEADS):
        sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sizes = {"num_attention_heads*head_dim": config.num_attention_heads * head_dim,
                 "num_key_value_heads*head_dim": config.num_key_value_heads * head_dim} if attention else {}
    sizes["intermediate_size"] = config.intermediate_size
    if moe:
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    return {**sizes, "vocab_size": config.vocab_size}
