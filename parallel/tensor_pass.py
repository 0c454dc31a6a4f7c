"""The TP pass: shard a decoder chunk as its TP plan says, then hook the partial gradients.

The plan is the family's (its declared `base_model_tp_plan` and head `_tp_plan`, through the adapter's `tp_plan`); each
style is one entry of `parallel.tensor_styles.STYLES`, which maps every style transformers declares onto Sluice's
replicated activations. Parameter names stay dense; a packed shard holds its block of every packed part
(`parallel.blocks`), so that checkpoints and dense weights slice by part.
"""

from __future__ import annotations

import math
import re
from functools import partial

import torch
from torch import nn

from .blocks import join_blocks, local_block  # noqa: F401  (re-exported: the TP blocks' one home is parallel.blocks)
from .collectives import all_reduce_
from .decoder import ContractError, Decoder
from .grid import ParallelGrid
from .tensor import ColumnParallelLinear, HiddenParallelEmbedding, RowParallelLinear, VocabParallelEmbedding
from .tensor_styles import GRAD_SUMMED, STYLES, Site

TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, HiddenParallelEmbedding)


def check_tp_divisibility(sizes: dict[str, int], tp: int) -> None:
    """Raise ValueError naming the first size (a model config key) that tp does not divide, and the valid choices."""
    common = math.gcd(*sizes.values())
    choices = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {name}={size}; choose tp in {{{choices}}}")


def apply_tensor_parallel(decoder: Decoder, grid: ParallelGrid) -> Decoder:
    """Shard the plan's modules and parameters, then hook the replicated parameters' gradient sums."""
    shard_modules(decoder, grid)
    sync_replicated_grads(decoder, grid)
    return decoder


def shard_modules(decoder: Decoder, grid: ParallelGrid) -> Decoder:
    """Replace the plan's modules and parameters in place by this rank's shards (works on meta modules).

    Parameter names stay dense; pieces a pruned chunk lacks are skipped; a Parameter shared by two modules (a tied
    embedding and head) stays one shared sharded Parameter. Then the adapter makes each layer read this rank's
    sizes where its forward reads global ones (`FamilyAdapter.tp_local`)."""
    check_tp_divisibility(decoder.adapter.tp_sizes(), grid.tp)
    if grid.tp == 1:
        return decoder
    model = decoder.module
    ties: dict[int, tuple[int, nn.Parameter]] = {}  # id(dense weight) -> (shard dim, shard), reused by a tie partner
    # The list keeps every dense module (and weight) alive through the loop, so no id() is recycled.
    for name, target, style in _planned(model, decoder.plan.tp_plan):
        if isinstance(target, TP_LAYERS):
            raise ValueError(f"apply_tensor_parallel: model already has TP modules ({type(target).__name__})")
        site = Site(name, target, style, grid, decoder.adapter, decoder.config, ties)
        if style not in STYLES:
            raise site.refuse("is not in Sluice's TP style table (parallel/tensor_styles.py)")
        built = STYLES[style](site)
        if built is None:
            continue
        if isinstance(target, nn.Module) and type(target) not in (nn.Linear, nn.Embedding):
            built = _keeping_behaviour(name, target, built, decoder.adapter)  # a subclass: keep its own forward
        if isinstance(target, nn.Module):  # a packed shard (dim -1 here) stands for no tie partner
            dim = -1 if getattr(built.weight, "tp_packed", 1) != 1 else built.weight.partition_dim
            ties.setdefault(id(target.weight), (dim, built.weight))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, built)
    for _, layer in decoder.blocks():
        decoder.adapter.tp_local(layer, grid.tp)
    return decoder


def grad_summed_params(decoder: Decoder, grid: ParallelGrid) -> list[nn.Parameter]:
    """The trainable replicated parameters that see only part of the sharded activations: their gradients sum over
    TP (`sync_replicated_grads`), so FSDP leaves them whole (`parallel.fsdp.kept_whole`)."""
    if grid.tp == 1:
        return []
    return [param for _, target, style in _planned(decoder.module, decoder.plan.tp_plan) if style in GRAD_SUMMED
            for param in ([target] if isinstance(target, nn.Parameter) else target.parameters(recurse=False))
            if param.requires_grad]  # a frozen weight has no gradient to sum


def sync_replicated_grads(decoder: Decoder, grid: ParallelGrid) -> None:
    """Replicated parameters that see only part of the sharded activations sum their gradient over TP.

    A leaf hook, not a trainer step: the gradient is exact as soon as backward returns. Registered after the
    weights are materialised, since a meta tensor's hooks do not survive getting storage."""
    for param in grad_summed_params(decoder, grid):
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
