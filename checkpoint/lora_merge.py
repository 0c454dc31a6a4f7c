"""LoRA adapters in a dense state_dict: their names (PEFT's `...q_proj.lora_A.weight`) and their merge into the
weights they adapt (the export of a LoRA run)."""

from __future__ import annotations

import torch

ADAPTERS = ("lora_A", "lora_B")  # the two children of an adapted linear, A [rank, in] then B [out, rank]


def is_adapter(name: str) -> bool:
    """Whether the dense parameter name `name` is a LoRA adapter's weight."""
    return name.rpartition(".")[0].rpartition(".")[2] in ADAPTERS


def adapter_pairs(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Linear name -> (lora_A, lora_B) of every adapter in a dense state_dict."""
    return {name[:-len(".lora_A.weight")]: (tensor, state[name.replace(".lora_A.", ".lora_B.")])
            for name, tensor in state.items() if name.endswith(".lora_A.weight")}


def merge_adapters(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A dense state_dict without adapters: each adapted weight W becomes W + (lora_B @ lora_A) * scale (computed in
    float64, rounded once to W's dtype)."""
    merged = {name: tensor for name, tensor in state.items() if not is_adapter(name)}
    for linear, (a, b) in adapter_pairs(state).items():
        weight = merged[f"{linear}.weight"]
        merged[f"{linear}.weight"] = (weight.double() + (b.double() @ a.double()) * scale).to(weight.dtype)
    return merged
