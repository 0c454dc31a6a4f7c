"""The adapter of transformers' own decoders (Llama, Qwen3, Qwen3-MoE): their classes run unmodified, split by the
plans they declare; this file says only what a plan cannot (see `parallel.decoder.FamilyAdapter`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from models.initialization import init_module_buffers, init_parameter
from models.sizes import tp_sizes
from parallel.decoder import DecodeContext, DecoderPlan
from parallel.recompute import GatedActivation, PackedGatedActivation, SdpaCore, UnknownRole
from parallel.tensor_pass import plan_pattern


class TransformersDecoderAdapter:
    """Rotary tables from the base model's `rotary_emb`, masks from transformers' own mask functions, layers called
    as the base model calls them, and the MoE aux loss from the routers its class records outputs of."""

    def __init__(self, model: nn.Module):
        self.config = config = model.config
        self.dense = model  # as built (on the meta device in a run): its modules and `_init_weights`, never values
        plan = DecoderPlan.of(model)
        recorded = getattr(type(model), "_can_record_outputs", None) or {}
        attention, router = recorded.get("attentions"), recorded.get("router_logits")
        self.attention_class = getattr(attention, "target_class", attention)
        self.router_class = getattr(router, "target_class", router)
        self.router_index = getattr(router, "index", 0)
        routers = [m for m in model.modules() if self.router_class is not None and isinstance(m, self.router_class)]
        # transformers adds the aux loss only with output_router_logits (its default is off); so do we.
        on = bool(routers) and bool(getattr(config, "output_router_logits", False))
        self.aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0)) if on else 0.0
        self.moe_layers = len(routers)
        ep_plan = getattr(config, "base_model_ep_plan", None) or {}
        self.expert_patterns = [plan_pattern(f"{plan.base}.{key}") for key in ep_plan]
        self.matmul_params = self._count_matmul_params(model, plan)

    # --- the forward, piece by piece ---------------------------------------------------------------------------

    def embed(self, base: nn.Module, embedding: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return embedding(input_ids)

    def layer_inputs(self, base: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
                     context: DecodeContext | None = None) -> dict:
        """What the base model's forward hands each layer: (cos, sin), the mask of each attention type, the cache."""
        mask_args = dict(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                         position_ids=position_ids)
        sized = {}  # attention type -> the chunk's first layer of it: the cache layer a mask is sized against
        if context is not None:
            mask_args.update(attention_mask=context.attention_mask, cache=context.cache)
            for layer_id in reversed(context.layer_ids):
                sized[self._mask_type(layer_id)] = layer_id
        masks = {"full_attention": create_causal_mask(**mask_args, layer_idx=sized.get("full_attention"))}
        if getattr(self.config, "sliding_window", None) is not None:
            masks["sliding_attention"] = create_sliding_window_causal_mask(
                **mask_args, layer_idx=sized.get("sliding_attention"))
        inputs = {"position_embeddings": self.rotary_tables(base, hidden, position_ids), "masks": masks,
                  "position_ids": position_ids}
        if context is not None:
            inputs["cache"] = context.cache
        return inputs

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)  # what the base model's forward makes with use_cache

    def rotary_tables(self, base: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor):
        """(cos, sin) of the base model's rotary module (a family with one table per layer type keys them)."""
        return base.rotary_emb(hidden, position_ids)

    def layer_tables(self, inputs: dict, layer_id: int):
        """The rotary tables layer `layer_id` takes."""
        return inputs["position_embeddings"]

    def _mask_type(self, layer_id: int) -> str:
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[layer_id]
        return "sliding_attention" if getattr(self.config, "sliding_window", None) is not None else "full_attention"

    def run_layer(self, layer_id: int, layer: nn.Module, hidden: torch.Tensor,
                  inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs = dict(attention_mask=inputs["masks"][self._mask_type(layer_id)], position_ids=inputs["position_ids"],
                      position_embeddings=self.layer_tables(inputs, layer_id))
        if "cache" in inputs:
            kwargs.update(cache=inputs["cache"], use_cache=True)
        if not (self.aux_coef and layer.training and torch.is_grad_enabled()):
            return layer(hidden, **kwargs), None
        logits: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda _m, _i, out: logits.append(out[self.router_index]))
                 for m in layer.modules() if isinstance(m, self.router_class)]
        try:
            hidden = layer(hidden, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        return hidden, sum(self._balance_loss(x) for x in logits) * (self.aux_coef / self.moe_layers)

    def _balance_loss(self, router_logits: torch.Tensor) -> torch.Tensor:
        """One layer's load-balancing loss, transformers' formula (Switch Transformer) on this layer alone.

        transformers pools the routers of every layer into one product of averages; that couples all pipeline
        stages, so each layer's loss is taken on its own and their mean stands for the pool (as Megatron-LM does)."""
        probs = F.softmax(router_logits.float(), dim=-1)
        experts = probs.shape[-1]
        chosen = torch.topk(probs, self.config.num_experts_per_tok, dim=-1).indices
        load = torch.zeros(experts, device=probs.device).index_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device)) / probs.shape[0]
        return (load * probs.mean(0)).sum() * experts

    # --- weights ---------------------------------------------------------------------------------------------------

    def init_tensor(self, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """The family's own `_init_weights` on the parameter's module (normal weights, the norms as the class
        centres them, zero biases, a zero padding row), drawn from `generator`."""
        owner = self.dense.get_submodule(name.rpartition(".")[0])
        return init_parameter(self.dense._init_weights, owner, name, shape, generator)

    def init_buffers(self, module: nn.Module) -> None:
        """Every buffer (rotary tables, scales) by the family's own `_init_weights` for the module holding it."""
        init_module_buffers(module._init_weights, module)

    def tp_module(self, dense: nn.Module, parallel: nn.Module) -> nn.Module | None:
        return None  # these families' planned modules are plain nn.Linear / nn.Embedding

    @classmethod
    def tp_plan(cls, declared: dict[str, str]) -> dict[str, str]:
        return declared  # the plan transformers declares

    def tp_parts(self, name: str) -> tuple[int, ...] | None:
        return None  # packed experts' gate_up_proj: equal halves

    def tp_local(self, layer: nn.Module, tp: int) -> None:
        return None  # the layers read head counts from their tensors (`view(..., -1, head_dim)`)

    # --- what the layout search, recompute and TP need -------------------------------------------------------

    def selective_recompute(self, layer: nn.Module) -> list:
        """By role: the attention core (the class the model records attentions of) and the activation of the layer's
        `mlp`, with separate gate and up projections or one packing both; an `UnknownRole` for either not found."""
        targets: list = [SdpaCore(sub, tuple(getattr(sub, n) for n in ("q_norm", "k_norm")
                                             if isinstance(getattr(sub, n, None), nn.Module)))
                         for sub in layer.modules()
                         if self.attention_class is not None and isinstance(sub, self.attention_class)]
        if not targets:
            targets.append(UnknownRole(layer, "attention core"))
        return [*targets, self._mlp_activation(layer)]

    @staticmethod
    def _mlp_activation(layer: nn.Module):
        """The gated activation of `layer.mlp` (its projections may be TP layers by now: found by name, not class)."""
        mlp = getattr(layer, "mlp", None)
        act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)

        def has(*names: str) -> bool:
            return all(isinstance(getattr(mlp, n, None), nn.Module) for n in names)

        if callable(act) and has("gate_proj", "up_proj", "down_proj"):
            return GatedActivation(mlp, mlp.gate_proj, mlp.up_proj, mlp.down_proj, act)
        if callable(act) and has("gate_up_proj", "down_proj"):
            return PackedGatedActivation(mlp, mlp.gate_up_proj, mlp.down_proj, act)
        return UnknownRole(mlp if mlp is not None else layer, "MLP activation")

    def moe_forward(self, block: nn.Module, experts) -> None:
        return None  # the experts module's own forward takes (tokens, top_k_index, top_k_weights)

    def expert_choices(self, block: nn.Module) -> tuple[nn.Module, Callable]:
        return block.gate, lambda routed: routed[-1]  # transformers' top-k routers return (..., top_k_index)

    def tp_sizes(self) -> dict[str, int]:
        return tp_sizes(self.config, bool(self.moe_layers), self.tp_plan(dict(self.config.base_model_tp_plan or {})))

    def matmul_params_per_token(self) -> int:
        return self.matmul_params

    def _count_matmul_params(self, model: nn.Module, plan: DecoderPlan) -> int:
        """Every matrix a token multiplies with: routed experts weighed by top-k of all, the head once (tied or not),
        never the embedding (a lookup)."""
        share = getattr(self.config, "num_experts_per_tok", 1) / max(getattr(self.config, "num_experts", 1) or 1, 1)
        total = 0.0
        for name, param in model.named_parameters():
            if param.dim() < 2 or plan.piece_of(name)[0] == "embedding":
                continue
            expert = any(p.fullmatch(name) or p.fullmatch(name.rpartition(".")[0]) for p in self.expert_patterns)
            total += param.numel() * (share if expert else 1)
        if plan.ties:
            total += model.get_submodule(plan.head).weight.numel()
        return int(total)

    def saved_bytes_per_layer(self, micro_batch_size: int, seq_len: int, dtype_bytes: int, mode: str,
                              tp: int = 1) -> None:
        return None  # no closed formula: the layout search measures a layer
