"""Tokens per expert: how evenly each MoE layer's router spread the step's tokens over its experts.

A forward hook on each router (the family adapter names it and reads its choice) counts the routed token copies
per global expert id on this rank, in training forwards only: not in validation, and not when recompute runs a
forward again inside the backward. A logged step sums the counts over every rank (TP ranks route the same tokens,
so only TP rank 0 adds its own) and reports, per layer, the busiest expert's load over the mean load.
"""

from __future__ import annotations

import torch
from torch import nn

from .collectives import all_reduce_
from .decoder import Decoder
from .expert import expert_modules


class ExpertLoad:
    """Routed token copies per (layer, expert) on this rank since the last `reset`."""

    def __init__(self, chunks: list[Decoder], num_layers: int, num_experts: int, device: torch.device):
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        for chunk in chunks:
            stack = chunk.plan.stack + "."
            for name, _ in expert_modules(chunk):
                layer = int(name[len(stack):].split(".", 1)[0])  # a pruned stack keeps the global layer ids
                block = chunk.module.get_submodule(name.rpartition(".")[0])
                router, choices = chunk.adapter.expert_choices(block)
                router.register_forward_hook(self._counter(layer, choices))  # lives as long as the router

    def _counter(self, layer: int, choices):
        counts = self.counts

        # Eager even inside a compiled layer: the layers share one compiled graph, which would bake in the first
        # layer's row, so every later layer's counts landed there (train.compile reported a wrong imbalance).
        @torch.compiler.disable
        def count(module: nn.Module, _inputs, output) -> None:
            # The step's forwards only: validation runs without grad, recompute inside a backward (a graph task).
            if module.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                with torch.no_grad():  # saves nothing for backward: recompute checks that it saves what this did
                    chosen = choices(output).reshape(-1)
                    counts[layer] += torch.bincount(chosen, minlength=counts.shape[1]).to(counts.dtype)
        return count

    def reset(self) -> None:
        self.counts.zero_()

    def record(self, group, tp_rank: int) -> dict:
        """Collective over `group` (every rank of the run): the step's imbalance per MoE layer (max / mean tokens
        per expert, 1 = even) as `expert_imbalance_by_layer`, and their mean as `expert_imbalance`."""
        mine = self.counts.clone() if tp_rank == 0 else torch.zeros_like(self.counts)  # TP ranks route alike
        totals = all_reduce_(mine, group).cpu()
        by_layer = {f"layer{i}": float(row.max() / row.mean()) for i, row in enumerate(totals) if row.sum() > 0}
        if not by_layer:
            return {}
        return {"expert_imbalance": sum(by_layer.values()) / len(by_layer), "expert_imbalance_by_layer": by_layer}
