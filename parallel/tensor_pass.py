"""The TP pass: shard a decoder chunk as its declared TP plan says, then hook the partial gradients.

Styles keep transformers' names. On a module: `colwise` / `rowwise` (a Linear becomes a Column/RowParallelLinear),
`embedding_rowwise` (a vocab-parallel Embedding), `replicated_with_grad_allreduce` (kept whole; its gradient is
partial and summed over TP), `moe_tp_experts` (a module of stacked experts: its floating inputs enter the TP region,
its partial output is summed). On a parameter, such as stacked experts [E, out, in]: `colwise` shards `out`,
`packed_colwise` shards each of its packed halves (gate and up) alike, `rowwise` shards `in`; they add no
collective of their own, `moe_tp_experts` on the owner does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from .collectives import all_reduce_
from .decoder import ContractError, Decoder
from .grid import ParallelGrid
from .tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp_region,
                     reduce_from_tp_region)

PACKED = {"packed_colwise": 2}  # style -> how many blocks lie side by side along the sharded dim


def check_tp_divisibility(sizes: dict[str, int], tp: int) -> None:
    """Raise ValueError naming the first size (a model config key) that tp does not divide, and the valid choices."""
    common = math.gcd(*sizes.values())
    choices = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {name}={size}; choose tp in {{{choices}}}")


def local_block(dense: torch.Tensor, tp_rank: int, tp: int, dim: int, packed: int = 1) -> torch.Tensor:
    """This TP rank's block of `dense` along `dim` (each of `packed` side-by-side halves sliced alike)."""
    return torch.cat([half.chunk(tp, dim=dim)[tp_rank] for half in dense.chunk(packed, dim=dim)], dim=dim)


def join_blocks(blocks: list[torch.Tensor], dim: int, packed: int = 1) -> torch.Tensor:
    """The dense tensor from every TP rank's block, in rank order (the inverse of `local_block`)."""
    halves = [block.chunk(packed, dim=dim) for block in blocks]
    return torch.cat([torch.cat([h[i] for h in halves], dim=dim) for i in range(packed)], dim=dim)


def apply_tensor_parallel(decoder: Decoder, grid: ParallelGrid) -> Decoder:
    """Shard the plan's modules and parameters, then hook the replicated parameters' gradient sums."""
    shard_modules(decoder, grid)
    sync_replicated_grads(decoder, grid)
    return decoder


def shard_modules(decoder: Decoder, grid: ParallelGrid) -> Decoder:
    """Replace the plan's modules and parameters in place by this rank's shards (works on meta modules).

    Parameter names stay dense; pieces a pruned chunk lacks are skipped; a Parameter shared by two modules (a tied
    embedding and head) stays one shared sharded Parameter."""
    check_tp_divisibility(decoder.adapter.tp_sizes(), grid.tp)
    if grid.tp == 1:
        return decoder
    model = decoder.module
    shards: dict[int, nn.Parameter] = {}  # id(dense weight) -> its dim-0 shard, reused by a tie partner
    # The list keeps every dense module (and weight) alive through the loop, so no id() is recycled.
    for name, target, style in _planned(model, decoder.plan.tp_plan):
        parent, _, child = name.rpartition(".")
        if isinstance(target, nn.Parameter):
            setattr(model.get_submodule(parent), child, _sharded_parameter(target, style, grid))
        elif style == "moe_tp_experts":
            target.forward = _ExpertsInRegion(target.forward, grid.tp_group)
        elif style != "replicated_with_grad_allreduce":
            setattr(model.get_submodule(parent), child,
                    _parallel_module(name, target, style, grid, shards, decoder.adapter))
    return decoder


def sync_replicated_grads(decoder: Decoder, grid: ParallelGrid) -> None:
    """Replicated parameters that see only part of the sharded activations sum their gradient over TP.

    A leaf hook, not a trainer step: the gradient is exact as soon as backward returns. Registered after the
    weights are materialised, since a meta tensor's hooks do not survive getting storage."""
    if grid.tp == 1:
        return
    for _, module, style in _planned(decoder.module, decoder.plan.tp_plan):
        if style == "replicated_with_grad_allreduce":
            for param in module.parameters(recurse=False):
                if param.requires_grad:  # a frozen weight has no gradient to sum
                    param.register_hook(partial(_all_reduce_grad, group=grid.tp_group))


def _all_reduce_grad(grad: torch.Tensor, group) -> torch.Tensor:
    """Sum a replicated parameter's partial gradient over TP (runs inside backward, every micro-batch)."""
    return all_reduce_(grad.clone(), group)


def plan_pattern(plan_key: str) -> re.Pattern:
    """Plan key with `*` wildcards (one name component each) -> compiled full-match regex."""
    return re.compile(re.escape(plan_key).replace(r"\*", r"[^.]+"))


def _planned(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module | nn.Parameter, str]]:
    """(name, module or parameter, style) of everything the TP plan names, modules first."""
    rules = [(plan_pattern(key), style) for key, style in plan.items()]

    def style_of(name: str) -> str | None:
        return next((s for pattern, s in rules if pattern.fullmatch(name)), None)

    found = [(n, m, s) for n, m in list(model.named_modules()) if (s := style_of(n)) is not None]
    return found + [(n, p, s) for n, p in list(model.named_parameters()) if (s := style_of(n)) is not None]


def _sharded_parameter(param: nn.Parameter, style: str, grid: ParallelGrid) -> nn.Parameter:
    """This rank's block of a planned parameter (its last dim is `in`, the one before it `out`)."""
    if style not in ("colwise", "rowwise", *PACKED) or param.dim() < 2:
        raise ValueError(f"apply_tensor_parallel: style {style!r} does not apply to a {param.dim()}-d parameter")
    dim, packed = param.dim() - (1 if style == "rowwise" else 2), PACKED.get(style, 1)
    local = nn.Parameter(local_block(param.detach(), grid.tp_rank, grid.tp, dim, packed).clone(), param.requires_grad)
    local.tensor_parallel, local.partition_dim, local.tp_packed = True, dim, packed
    return local


class _ExpertsInRegion:
    """A `moe_tp_experts` forward: every floating input enters the TP region, the partial output is summed.
    (A class, not a closure, so that deepcopy rebinds it to the copy.)"""

    def __init__(self, forward: Callable, group):
        self.forward, self.group = forward, group

    def __call__(self, *args, **kwargs):
        def enter(x):
            return copy_to_tp_region(x, self.group) if torch.is_tensor(x) and x.is_floating_point() else x

        out = self.forward(*(enter(a) for a in args), **{k: enter(v) for k, v in kwargs.items()})
        return reduce_from_tp_region(out, self.group)


def _parallel_module(name: str, module: nn.Module, style: str, grid: ParallelGrid, shards: dict,
                     adapter) -> nn.Module:
    """The TP replacement of one dense module under style."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
        raise ValueError(f"apply_tensor_parallel: model already has TP modules ({type(module).__name__})")
    tied = shards.get(id(module.weight))
    if style in ("colwise", "colwise_gather_output") and isinstance(module, nn.Linear):
        new = ColumnParallelLinear.from_dense(module, grid, style == "colwise_gather_output", weight=tied)
    elif style == "rowwise" and isinstance(module, nn.Linear):
        new = RowParallelLinear.from_dense(module, grid)
    elif style == "embedding_rowwise" and isinstance(module, nn.Embedding):
        new = VocabParallelEmbedding.from_dense(module, grid, weight=tied)
    else:
        raise ValueError(f"apply_tensor_parallel: style {style!r} does not apply to {type(module).__name__}")
    if type(module) not in (nn.Linear, nn.Embedding):  # a subclass: its own forward would be dropped silently
        new = _keeping_behaviour(name, module, new, adapter)
    if style != "rowwise":  # only row-sliced (dim 0) shards can stand for a tied partner
        shards[id(module.weight)] = new.weight
    return new


def _keeping_behaviour(name: str, module: nn.Module, parallel: nn.Module, adapter) -> nn.Module:
    """The family's TP module for a subclass of nn.Linear / nn.Embedding (Gemma3's scaled embedding): the plain TP
    layer would compute the base class's forward only, so the adapter must say how to keep the subclass's."""
    kept = adapter.tp_module(module, parallel)
    if kept is None:
        base = "nn.Linear" if isinstance(module, nn.Linear) else "nn.Embedding"
        raise ContractError(f"{name} is a {type(module).__name__}, a subclass of {base} that {type(parallel).__name__} "
                            f"would replace by the base class's forward; {type(adapter).__name__}.tp_module must "
                            "return a TP module keeping its behaviour")
    return kept
