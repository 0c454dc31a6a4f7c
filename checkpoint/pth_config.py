"""The MiniMind config a MiniMind `.pth` state_dict implies, read from its tensors' shapes.

A `.pth` (MiniMind's `full_sft_768.pth`, or `checkpoint.export_pth`'s) holds weights and no config. Every size the
model allocates is a shape in it: vocabulary and width (the embedding), layers (the highest layer index), head size
(`q_norm`), query and key/value heads (`q_proj` / `k_proj` rows over the head size), the MLP's width, MoE's experts
and their width. What no shape holds takes MiniMind's default: RoPE base 1e6, 32768 positions, top-1 routing.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from checkpoint.errors import CheckpointError
from minimind import MiniMindConfig

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
NEEDED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight",
          "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight")


def pth_config(state: dict[str, torch.Tensor], where: str | Path) -> MiniMindConfig:
    """The MiniMindConfig whose model holds `state` (a MiniMind state_dict); CheckpointError naming `where`."""
    if missing := [k for k in NEEDED if k not in state]:
        raise CheckpointError(f"{where}: not a MiniMind state_dict (no {missing[0]}); give a MiniMind .pth, an HF "
                              "folder or a Sluice run directory")
    vocab, hidden = state["model.embed_tokens.weight"].shape
    head_dim = state["model.layers.0.self_attn.q_norm.weight"].shape[0]
    layers = 1 + max(int(m.group(1)) for k in state if (m := LAYER.match(k)))
    fields = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, head_dim=head_dim,
                  num_attention_heads=state["model.layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
                  num_key_value_heads=state["model.layers.0.self_attn.k_proj.weight"].shape[0] // head_dim)
    if "model.layers.0.mlp.gate.weight" in state:
        fields.update(use_moe=True, num_experts=state["model.layers.0.mlp.gate.weight"].shape[0],
                      moe_intermediate_size=state["model.layers.0.mlp.experts.0.gate_proj.weight"].shape[0])
    else:
        fields["intermediate_size"] = state["model.layers.0.mlp.gate_proj.weight"].shape[0]
    return MiniMindConfig(**fields)
