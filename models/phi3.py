"""Phi-3 (`Phi3ForCausalLM`): fused projections split by heads under TP, never gathered.

transformers declares `colwise_gather_output` for the fused `qkv_proj` [q | k | v] and `gate_up_proj` [gate | up] and
`rowwise_split_input` after them: every rank then computes all of attention and the activation, after an all-gather
per fused projection. This adapter plans them `packed_colwise` by parts instead (Megatron's layout): each rank holds
its own heads' q, k and v rows (unequal parts under GQA) and its own gate and up rows, and `o_proj` / `down_proj` are
plain `rowwise`. Phi-3's attention slices its local [q | k | v] at the config's head counts, so after the TP pass each
attention reads this rank's counts (`tp_local`). Dense names and checkpoints stay transformers' own.
"""

from __future__ import annotations

import copy

from torch import nn

from models.transformers_decoder import TransformersDecoderAdapter

QKV = "layers.*.self_attn.qkv_proj"
BY_HEADS = {  # transformers' declared style -> the split-by-heads one, per fused projection and its consumer
    QKV: "packed_colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise"}


class Phi3Adapter(TransformersDecoderAdapter):
    """Phi-3's fused projections split by heads; everything else as transformers' other decoders."""

    @classmethod
    def tp_plan(cls, declared: dict[str, str]) -> dict[str, str]:
        return {key: BY_HEADS.get(key, style) for key, style in declared.items()}

    def tp_parts(self, name: str) -> tuple[int, ...] | None:
        """qkv_proj's rows [q | k | v] by head count (gate_up_proj: equal halves, the default)."""
        if not name.endswith("self_attn.qkv_proj"):
            return None
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return (c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim, c.num_key_value_heads * head_dim)

    def tp_local(self, layer: nn.Module, tp: int) -> None:
        """The attention slices its packed output at this rank's head counts (its own config copy says them); under
        a plan that gathers qkv_proj's output (transformers' declared one) every rank keeps every head."""
        if self.tp_plan(dict(self.config.base_model_tp_plan or {})).get(QKV) != "packed_colwise":
            return
        attention = layer.self_attn
        local = copy.copy(attention.config)
        local.num_attention_heads = attention.config.num_attention_heads // tp
        local.num_key_value_heads = attention.config.num_key_value_heads // tp
        attention.config, attention.num_key_value_heads = local, local.num_key_value_heads
