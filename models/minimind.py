"""MiniMind's adapter: what its declared plans cannot tell the parallel layer (see `parallel.decoder.FamilyAdapter`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from minimind import MiniMindConfig
from minimind.model import Attention, FeedForward, build_attention_mask
from models.initialization import init_parameter
from models.sizes import tp_sizes
from parallel.decoder import DecodeContext
from parallel.recompute import MODES, GatedActivation, SdpaCore


class MiniMindAdapter:
    """MiniMind-3, dense or MoE: embedding dropout, RoPE tables as buffers, layers returning (hidden, aux)."""

    def __init__(self, model: nn.Module):
        self.config: MiniMindConfig = model.config
        self.dense = model  # as built (on the meta device in a run): its modules and `_init_weights`, never values

    def embed(self, base: nn.Module, embedding: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return base.dropout(embedding(input_ids))

    def layer_inputs(self, base: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
                     context: DecodeContext | None = None) -> dict:
        inputs = {"cos": base.rope_cos[position_ids], "sin": base.rope_sin[position_ids]}
        if context is not None:  # the mask MiniMindModel.forward makes over its cache's past
            past = context.cache.get_seq_length(context.layer_ids[0]) if context.layer_ids else 0
            inputs["mask"] = build_attention_mask(context.attention_mask, hidden.shape[1], past, hidden.device)
            inputs["cache"] = context.cache
        return inputs

    def run_layer(self, layer_id: int, layer: nn.Module, hidden: torch.Tensor,
                  inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if "cache" in inputs:
            return layer(hidden, inputs["cos"], inputs["sin"], inputs["mask"], inputs["cache"])
        return layer(hidden, inputs["cos"], inputs["sin"])

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)  # MiniMind's attention calls `cache.update(k, v, layer_id)`

    def init_tensor(self, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """MiniMind's own `_init_weights` on the parameter's module: normal(0, initializer_range), ones for norms."""
        owner = self.dense.get_submodule(name.rpartition(".")[0])
        return init_parameter(self.dense._init_weights, owner, name, shape, generator)

    def init_buffers(self, module: nn.Module) -> None:
        module.model.reset_rope()

    def tp_module(self, dense: nn.Module, parallel: nn.Module) -> nn.Module | None:
        return None  # MiniMind's planned modules are plain nn.Linear / nn.Embedding

    @classmethod
    def tp_plan(cls, declared: dict[str, str]) -> dict[str, str]:
        return declared  # MiniMindConfig's own

    def tp_parts(self, name: str) -> tuple[int, ...] | None:
        return None  # no packed projections

    def tp_local(self, layer: nn.Module, tp: int) -> None:
        return None  # the model reads head counts from its tensors

    def selective_recompute(self, layer: nn.Module) -> list:
        """The attention core (q/k norms, SDPA) and each SwiGLU's silu(gate) * up, experts' included."""
        targets = []
        for sub in layer.modules():
            if type(sub) is Attention:
                targets.append(SdpaCore(sub, (sub.q_norm, sub.k_norm)))
            elif type(sub) is FeedForward:
                targets.append(GatedActivation(sub, sub.gate_proj, sub.up_proj, sub.down_proj, F.silu))
        return targets

    def moe_forward(self, block: nn.Module, experts: Callable) -> Callable:
        return RoutedExperts(block, experts)

    def expert_choices(self, block: nn.Module) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
        return block.gate, lambda logits: choose(block, logits)[2]  # the gate returns logits; the block picks

    def tp_sizes(self) -> dict[str, int]:
        return tp_sizes(self.config, self.config.use_moe)

    def matmul_params_per_token(self) -> int:
        """Every projection, the experts a token runs through and the router, and the LM head."""
        c = self.config
        h, head_dim = c.hidden_size, c.head_dim
        attention = h * c.num_attention_heads * head_dim * 2 + h * c.num_key_value_heads * head_dim * 2
        if c.use_moe:  # a token runs through num_experts_per_tok experts; the router is one more h x E matmul
            mlp = 3 * h * c.moe_intermediate_size * c.num_experts_per_tok + h * c.num_experts
        else:
            mlp = 3 * h * c.intermediate_size
        return c.num_hidden_layers * (attention + mlp) + h * c.vocab_size  # the embedding lookup is no matmul

    def saved_bytes_per_layer(self, micro_batch_size: int, seq_len: int, dtype_bytes: int, mode: str,
                              tp: int = 1) -> int:
        return saved_activation_bytes_per_layer(self.config, micro_batch_size, seq_len, dtype_bytes, mode, tp)


class RoutedExperts:
    """`MoEFeedForward.forward` with its expert loop handed to `experts(tokens, top_k_index, top_k_weights)`.

    The model routes and runs its experts in one loop; the EP pass needs the two apart, and the model file stays
    as it is, so its routing and aux loss are restated here, line for line (tests check both give the same numbers).
    (A class, not a closure, so that deepcopy rebinds it to the copy.)"""

    def __init__(self, block: nn.Module, experts: Callable):
        self.block, self.experts = block, experts

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block, shape = self.block, x.shape
        tokens = x.reshape(-1, shape[-1])
        scores, weights, chosen = choose(block, block.gate(tokens))
        out = self.experts(tokens, chosen, weights.to(tokens.dtype))
        aux = tokens.new_zeros((), dtype=torch.float32)
        if block.training and block.aux_loss_coef > 0:
            num_experts = scores.shape[-1]
            load = F.one_hot(chosen.reshape(-1), num_experts).float().mean(0)
            aux = (load * scores.mean(0)).sum() * num_experts * block.aux_loss_coef
        return out.view(shape), aux


def choose(block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`MoEFeedForward`'s routing from its gate's logits: (scores, top-k weights, chosen expert ids)."""
    scores = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(scores, block.top_k, dim=-1, sorted=False)
    if block.norm_topk_prob and block.top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif block.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return scores, weights, chosen


def saved_activation_bytes_per_layer(config: MiniMindConfig, micro_batch_size: int, seq_len: int, dtype_bytes: int,
                                     mode: str, tp: int = 1) -> int:
    """Bytes one MiniMind decoder layer saves for backward per micro-batch on a TP rank."""
    # As saved-tensor hooks count them (each storage once, parameters and their casts not at all), for causal
    # attention without a mask (a fused SDPA kernel: output plus fp32 log-sum-exp), dropout 0 and no sequence
    # parallelism. Norms and the residual stream are fp32; under autocast (`dtype_bytes` < 4) each linear
    # saves its own cast of its input. Exact for dense layers; MoE totals are exact too, since every token is
    # routed to exactly top-k experts (the tests check both against the hooks).
    if mode not in MODES:
        raise ValueError(f"train.recompute={mode!r} is not a recompute mode: use one of {'|'.join(MODES)}")
    tokens, f, a, h = micro_batch_size * seq_len, 4, dtype_bytes, config.hidden_size
    if mode == "full":
        return tokens * f * h  # the layer's input
    heads, kv_heads = config.num_attention_heads // tp, max(config.num_key_value_heads // tp, 1)
    q, kv = heads * config.head_dim, kv_heads * config.head_dim
    casts = 1 if a < f else 0  # a cast linear input is one more copy per extra consumer
    selective = mode == "selective"
    per_token = 2 * f * (2 * h + 1)  # input and post-attention norms: input, rsqrt, normalised
    per_token += a * h * (1 + 2 * casts)  # q/k/v input
    # q/k norms: fp32 input, rsqrt, normalised (selective: only their input, recomputed in backward).
    per_token += a * (q + kv) if selective else f * (q + heads + kv + kv_heads) + a * (q + kv)
    per_token += a * (2 * q + 2 * kv) + (0 if selective else f * heads)  # SDPA: q, k, v, output (o_proj's input)
    if not config.use_moe:
        # MLP input, then gate, up, silu(gate) and down's input (selective recomputes silu(gate)).
        return tokens * (per_token + a * h * (1 + casts) + a * config.intermediate_size // tp * (3 if selective else 4))
    return tokens * per_token + _moe_bytes(config, tokens, a, tp, selective)


def _moe_bytes(config: MiniMindConfig, tokens: int, a: int, tp: int, selective: bool) -> int:
    """The routed MLP's saved bytes: the router's per token, each of the top-k experts' per routed token."""
    f, h, k = 4, config.hidden_size, config.num_experts_per_tok
    casts = 1 if a < f else 0
    router = a * h + f * config.num_experts + 8 * k + f * (k + 1)  # input, scores, choice, weights
    # Per routed token: row and slot indices, the gathered input as gate and up see it, the SwiGLU, the
    # expert's output and its routing weight, the weighted output.
    expert = 16 + a * h * (1 + casts) + a * config.moe_intermediate_size // tp * (3 if selective else 4)
    expert += a * h + f + f * h
    return tokens * (router + k * expert) + f * config.num_experts  # + the aux loss's expert load

