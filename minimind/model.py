"""MiniMind-3: a Qwen3-style decoder (GQA, q/k norm, RoPE, SwiGLU or MoE), written for one device.

Shapes are read from tensors (``view(B, S, -1, head_dim)``) so that the same code runs whole,
tensor-sharded (fewer heads per module) or pipeline-pruned (fewer layers, no embedding or head).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .config import MiniMindConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_tables(config: MiniMindConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] in rotate-half layout, with optional YaRN scaling."""
    dim, base, end = config.head_dim, config.rope_theta, config.max_position_embeddings
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, device=device).float() / dim))
    attention_factor = 1.0
    scaling = config.yarn_scaling
    if scaling is not None:
        orig, factor = scaling["original_max_position_embeddings"], scaling["factor"]
        attention_factor = scaling.get("attention_factor", 1.0)
        if end / orig > 1.0:
            # YaRN: interpolate low frequencies by `factor`, keep high ones, ramp in between.
            def dim_for(beta: float) -> float:
                return dim * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(dim_for(scaling["beta_fast"])), 0)
            high = min(math.ceil(dim_for(scaling["beta_slow"])), dim // 2 - 1)
            ramp = ((torch.arange(dim // 2, device=device).float() - low) / max(high - low, 0.001)).clamp(0, 1)
            freqs = freqs * (1 - ramp + ramp / factor)
    angles = torch.outer(torch.arange(end, device=device).float(), freqs)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1) * attention_factor
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1) * attention_factor
    return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by per-position cos/sin [B or 1, S, D]."""
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query attention with per-head q/k RMSNorm before RoPE."""

    def __init__(self, config: MiniMindConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        h, q_out, kv_out = config.hidden_size, config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(h, q_out, bias=False)
        self.k_proj = nn.Linear(h, kv_out, bias=False)
        self.v_proj = nn.Linear(h, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, h, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, seq, -1, self.head_dim))
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_id)
        # Heads per module come from the weights, so a TP shard holds fewer of both kinds.
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None and seq > 1, enable_gqa=True,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts with a softmax router and a load-balancing aux loss."""

    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_loss_coef = config.router_aux_loss_coef
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            FeedForward(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores = F.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        elif self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        # Rows (token * top_k + slot) expert by expert, each expert's in ascending order as torch.where gives them,
        # split by one read of the counts per layer (not a data-dependent torch.where, one device sync, per expert).
        rows = torch.argsort(chosen.reshape(-1), stable=True)
        counts = torch.bincount(chosen.reshape(-1), minlength=len(self.experts)).tolist()
        for expert, mine in zip(self.experts, rows.split(counts)):
            if mine.numel() == 0:
                # Touch the expert so every rank's autograd graph has the same parameters.
                out = out + 0.0 * sum(p.sum() for p in expert.parameters())
                continue
            token_idx, slot = mine // self.top_k, mine % self.top_k
            y = expert(tokens[token_idx]) * weights[token_idx, slot, None].to(tokens.dtype)
            out = out.index_add(0, token_idx, y)
        aux = tokens.new_zeros((), dtype=torch.float32)
        if self.training and self.aux_loss_coef > 0:
            num_experts = scores.shape[-1]
            load = F.one_hot(chosen.reshape(-1), num_experts).float().mean(0)
            aux = (load * scores.mean(0)).sum() * num_experts * self.aux_loss_coef
        return out.view(shape), aux


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: MiniMindConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoEFeedForward(config) if config.use_moe else FeedForward(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        mlp_out = self.mlp(self.post_attention_layernorm(x))
        if isinstance(mlp_out, tuple):
            mlp_out, aux = mlp_out
        else:
            aux = x.new_zeros((), dtype=torch.float32)
        return x + mlp_out, aux


class MiniMindPreTrainedModel(PreTrainedModel):
    """Shared transformers plumbing: config class, init, and RoPE tables recomputed on load."""

    config_class = MiniMindConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, MiniMindModel):
            module.reset_rope()


class MiniMindModel(MiniMindPreTrainedModel):
    """Embedding, decoder layers keyed by global layer id, final norm."""

    def __init__(self, config: MiniMindConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        # Keys are global layer ids so that a pruned copy keeps `layers.5....` as its names.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in range(config.num_hidden_layers)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.post_init()

    def reset_rope(self) -> None:
        """Recompute the non-persistent RoPE tables (after meta init or from_pretrained)."""
        device = self.rope_cos.device if self.rope_cos.device.type != "meta" else None
        cos, sin = rope_tables(self.config, device)
        self.rope_cos, self.rope_sin = cos, sin

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (hidden_states, aux_loss summed over this module's layers)."""
        x = self.dropout(self.embed_tokens(input_ids)) if inputs_embeds is None else inputs_embeds
        batch, seq = x.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=x.device).unsqueeze(0)
        cos, sin = self.rope_cos[position_ids], self.rope_sin[position_ids]
        mask = build_attention_mask(attention_mask, seq, past, x.device)
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers.values():
            x, layer_aux = layer(x, cos, sin, mask, cache)
            aux = aux + layer_aux
        if self.norm is not None:
            x = self.norm(x)
        return x, aux


def build_attention_mask(attention_mask: torch.Tensor | None, seq: int, past: int,
                         device: torch.device) -> torch.Tensor | None:
    """Boolean [B, 1, S, past+S] mask (causal and padding), or None when plain causal suffices."""
    if attention_mask is None or bool(attention_mask.all()):
        if past == 0 or seq == 1:
            return None
        attention_mask = torch.ones(1, past + seq, dtype=torch.bool, device=device)
    keys = torch.arange(past + seq, device=device)
    queries = torch.arange(past, past + seq, device=device)
    causal = keys[None, :] <= queries[:, None]
    return causal[None, None] & attention_mask[:, None, None, -(past + seq):].bool()


class MiniMindForCausalLM(MiniMindPreTrainedModel, GenerationMixin):
    """MiniMind language model: base model plus tied `lm_head`; returns logits, loss and aux_loss."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: MiniMindConfig):
        super().__init__(config)
        self.model = MiniMindModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, cache=None, past_key_values=None,
                use_cache: bool | None = None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        hidden, aux = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                 position_ids=position_ids, cache=cache if use_cache or cache is not None else None)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        output = CausalLMOutputWithPast(loss=loss, logits=logits)
        if cache is not None:
            output["cache"] = cache
        output["aux_loss"] = aux
        return output
