"""MiniMind as the stock transformers family it equals: a dense MiniMind-3 is transformers' Qwen3, an MoE one Qwen3-MoE.

The config maps field by field; the weights keep their names (Qwen3-MoE's stacked experts are built from MiniMind's
per-expert tensors by transformers' own declared conversion, `checkpoint.conversions`). The mapping is proven on the
model being exported: every key loads strictly and the stock model's logits equal MiniMind's before anything is
written. Where no stock family computes the same numbers (MiniMind's own YaRN, its residual dropout), there is none.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from checkpoint.dense import CheckpointError, convert_layouts

LOGITS_ATOL = 1e-4  # fp32 kernels of the two implementations round apart by ~1e-6; a mapping mistake is O(1)
PROBE_TOKENS = 16


def stock_config(config: PretrainedConfig) -> tuple[PretrainedConfig | None, str | None]:
    """(the Qwen3 / Qwen3-MoE config equal to MiniMind `config`, None), or (None, why no stock family equals it)."""
    if config.inference_rope_scaling:
        return None, "model.inference_rope_scaling=true (MiniMind's own YaRN) has no exact stock equivalent"
    if config.dropout:
        return None, f"model.dropout={config.dropout} (MiniMind's residual dropout) has no stock equivalent"
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta}, attention_bias=False,
        attention_dropout=0.0, use_sliding_window=False, initializer_range=config.initializer_range,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    if not config.use_moe:
        return Qwen3Config(**common), None
    return Qwen3MoeConfig(**common, moe_intermediate_size=config.moe_intermediate_size,
                          num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                          norm_topk_prob=config.norm_topk_prob, router_aux_loss_coef=config.router_aux_loss_coef,
                          decoder_sparse_step=1, mlp_only_layers=[]), None


def stock_model(model: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(the stock model holding `model`'s weights, None), or (None, why there is none); CheckpointError when the
    mapping is wrong (a key that does not load, logits that differ): a contract mistake, never written."""
    config, why = stock_config(model.config)
    if config is None:
        return None, why
    stock = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=next(model.parameters()).dtype)
    state = convert_layouts(dict(model.state_dict()), set(stock.state_dict()), config.model_type)
    missing, unexpected = stock.load_state_dict(state, strict=False)
    name = type(stock).__name__
    if missing or unexpected:
        raise CheckpointError(f"MiniMind -> {name}: keys missing {sorted(missing)[:3]}, unexpected "
                              f"{sorted(unexpected)[:3]}; export with --format minimind")
    stock.eval()
    ids = (torch.arange(PROBE_TOKENS) * 7919 % config.vocab_size).view(1, -1)
    was_training = model.training
    with torch.no_grad():
        ours, theirs = model.eval()(input_ids=ids).logits, stock(input_ids=ids).logits
    model.train(was_training)
    gap = float((ours.float() - theirs.float()).abs().max())
    if not gap <= LOGITS_ATOL:
        raise CheckpointError(f"MiniMind -> {name}: the logits differ by {gap:.3g} (more than {LOGITS_ATOL}); "
                              "export with --format minimind")
    return stock, None
