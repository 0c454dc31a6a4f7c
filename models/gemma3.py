"""Gemma3's text decoder (`Gemma3ForCausalLM`): what sets it apart from the other transformers decoders.

Two rotary tables (local for sliding-window layers, global for full-attention ones), each layer taking its type's;
an embedding that scales its output by sqrt(hidden) (a subclass of nn.Embedding, kept under TP by
`ScaledVocabParallelEmbedding`); its zero-centred norms and the scale come from its own `_init_weights`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from models.transformers_decoder import TransformersDecoderAdapter
from parallel.decoder import ContractError
from parallel.tensor import VocabParallelEmbedding

if TYPE_CHECKING:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

UNSUPPORTED = {"final_logit_softcapping": None, "use_bidirectional_attention": False}  # key -> the value Sluice runs


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """`Gemma3TextScaledWordEmbedding` under TP: this rank's vocabulary rows, the output times `embed_scale` (a
    buffer cast to the weight's dtype, as Gemma3 multiplies)."""

    def __init__(self, parallel: VocabParallelEmbedding, dense: Gemma3TextScaledWordEmbedding):
        super().__init__(parallel.weight, parallel.vocab_start, parallel.group, parallel.padding_idx)
        self.scalar_embed_scale = dense.scalar_embed_scale
        self.register_buffer("embed_scale", dense.embed_scale.clone(), persistent=False)  # meta in a run: set later

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class Gemma3Adapter(TransformersDecoderAdapter):
    """Gemma3's layers take the rotary table of their attention type; its scaled embedding keeps its scale."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        for key, runs in UNSUPPORTED.items():
            if getattr(self.config, key, runs) != runs:
                raise ContractError(f"model.{key}={getattr(self.config, key)} is not supported for gemma3_text "
                                    f"models (Sluice runs {key}={runs}); set it so in model.hf_config's config.json")

    def rotary_tables(self, base: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
        return {kind: base.rotary_emb(hidden, position_ids, kind) for kind in sorted(set(self.config.layer_types))}

    def layer_tables(self, inputs: dict, layer_id: int):
        return inputs["position_embeddings"][self._mask_type(layer_id)]

    def init_buffers(self, module: nn.Module) -> None:
        super().init_buffers(module)
        for sub in module.modules():  # Gemma3's `_init_weights` knows its own embedding class, not the TP one
            if isinstance(sub, ScaledVocabParallelEmbedding):
                sub.embed_scale.fill_(sub.scalar_embed_scale)

    def tp_module(self, dense: nn.Module, parallel: nn.Module) -> nn.Module | None:
        # Imported here: the registry imports this module in every process, and modeling_gemma3 costs 0.1-0.7 s.
        from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

        if isinstance(dense, Gemma3TextScaledWordEmbedding) and isinstance(parallel, VocabParallelEmbedding):
            return ScaledVocabParallelEmbedding(parallel, dense)
        return None
