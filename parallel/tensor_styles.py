"""Every TP style transformers declares, each one entry of `STYLES`: its name -> the builder that applies it.

Sluice keeps activations replicated between TP regions (no sequence parallelism): a TP region starts with a
column-parallel layer, whose input is whole on every rank, and ends with a row-parallel one, whose output is summed.
Each entry says how transformers' style maps onto that. A builder takes the planned module or parameter (a `Site`)
and returns its replacement, or None where the target stays (maybe with its forward wrapped in place). A family whose
declared plans name a style missing here is refused when it registers (`models/registry.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .blocks import Parts
from .decoder import ContractError
from .grid import ParallelGrid
from .tensor import (ColumnParallelLinear, HiddenParallelEmbedding, RowParallelLinear, VocabParallelEmbedding,
                     copy_to_tp_region, reduce_from_tp_region, shard_param, tp_slice)


@dataclass(frozen=True)
class Site:
    """One planned module or parameter of a chunk, as a builder sees it."""

    name: str  # its dense name
    target: nn.Module | nn.Parameter
    style: str
    grid: ParallelGrid
    adapter: Any  # the family's `parallel.decoder.FamilyAdapter`
    config: Any  # the model config (a few styles read a size from it)
    ties: dict[int, tuple[int, nn.Parameter]]  # id(dense weight) -> (its shard's dim, the shard): a tie partner's

    def refuse(self, why: str) -> ContractError:
        """One line naming family, module and style, and why the style cannot apply."""
        family = getattr(self.config, "model_type", "?")
        return ContractError(f"family {family!r}: {self.name} declares TP style {self.style!r}, which {why}")

    def packed(self) -> Parts:
        """How the target's parts lie along the sharded dim: the adapter's sizes, else transformers' equal halves."""
        return self.adapter.tp_parts(self.name) or 2


Builder = Callable[[Site], "nn.Module | nn.Parameter | None"]


def _linear(site: Site) -> nn.Linear:
    if not isinstance(site.target, nn.Linear):
        raise site.refuse(f"applies to an nn.Linear, not a {type(site.target).__name__}")
    return site.target


def _tied(site: Site, dim: int) -> nn.Parameter | None:
    """The shard a tie partner already made of this module's weight (None: none yet); refused when that partner
    sharded it along another dim, which would untie the pair silently."""
    made = site.ties.get(id(site.target.weight))
    if made is not None and made[0] != dim:
        raise site.refuse(f"shards a tied weight along dim {dim} where its tie partner's style shards dim {made[0]}; "
                          "plan both alike")
    return None if made is None else made[1]


def _untied(site: Site) -> None:
    """Refuse a style whose shard cannot stand for a tie partner's (it slices the input dim, or packed parts) when
    a partner has already sharded this weight: making a second shard would untie the pair silently."""
    if id(site.target.weight) in site.ties:
        raise site.refuse("shards a tied weight in a way its tie partner's shard cannot share; plan both alike")


def _untied_linear(site: Site) -> nn.Linear:
    """The target as an nn.Linear whose weight no tie partner has sharded yet (`_untied`)."""
    linear = _linear(site)
    _untied(site)
    return linear


def _sharded_parameter(site: Site, dim_from_end: int, packed: Parts = 1) -> nn.Parameter:
    """This rank's block of a planned parameter (its last dim is `in`, the one before it `out`): no collective of its
    own, the owner's style (`moe_tp_experts`) runs it."""
    param = site.target
    if param.dim() < 2:
        raise site.refuse(f"needs a parameter of 2 or more dims, not {param.dim()}")
    dim = param.dim() - dim_from_end
    local = shard_param(tp_slice(param.detach(), dim, site.grid.tp_rank, site.grid.tp, packed), dim, packed)
    local.requires_grad_(param.requires_grad)
    return local


def colwise(site: Site):
    """Output rows split; the output stays sharded into the region (a parameter: its `out` dim)."""
    if isinstance(site.target, nn.Parameter):
        return _sharded_parameter(site, 2)
    return ColumnParallelLinear.from_dense(_linear(site), site.grid, weight=_tied(site, 0))


def colwise_gather_output(site: Site):
    """`colwise_gather_output` and `colwise_rep`: output rows split, the output gathered whole (all-gather forward,
    this rank's slice of the gradient backward), so the module after it computes on whole activations."""
    if isinstance(site.target, nn.Parameter):
        raise site.refuse("gathers a module's output; a bare parameter has none (plan its owner)")
    return ColumnParallelLinear.from_dense(_linear(site), site.grid, gather_output=True, weight=_tied(site, 0))


def rowwise(site: Site):
    """Input columns split: the input is this rank's shard of the region, the output is summed (all-reduce)."""
    if isinstance(site.target, nn.Parameter):
        return _sharded_parameter(site, 1)
    return RowParallelLinear.from_dense(_untied_linear(site), site.grid)


def rowwise_split_input(site: Site):
    """`rowwise_split_input` and `rowwise_rep`: the input arrives whole (after a gathered colwise), each rank takes
    its block of it (backward: the gradient's blocks all-gathered), then a row-parallel layer sums the output."""
    if isinstance(site.target, nn.Parameter):
        raise site.refuse("splits a module's input; a bare parameter has none (plan its owner)")
    return RowParallelLinear.from_dense(_untied_linear(site), site.grid, split_input=True)


def packed_colwise(site: Site):
    """Output rows split within each packed part ([gate | up], Phi-3's [q | k | v] by heads): this rank's output is
    [part_0 block | part_1 block | ...], so the module's own split of its output works on it, and nothing gathers."""
    if isinstance(site.target, nn.Parameter):
        return _sharded_parameter(site, 2, site.packed())
    return ColumnParallelLinear.from_dense(_untied_linear(site), site.grid, packed=site.packed())


def packed_rowwise(site: Site):
    """Input columns split within each packed part: the input is a packed colwise layer's local output."""
    if isinstance(site.target, nn.Parameter):
        return _sharded_parameter(site, 1, site.packed())
    return RowParallelLinear.from_dense(_untied_linear(site), site.grid, packed=site.packed())


def embedding_rowwise(site: Site):
    """Vocabulary rows split; ids outside this rank's rows look up 0, the lookups are summed (all-reduce)."""
    if not isinstance(site.target, nn.Embedding):
        raise site.refuse(f"applies to an nn.Embedding, not a {type(site.target).__name__}")
    return VocabParallelEmbedding.from_dense(site.target, site.grid, weight=_tied(site, 0))


def embedding_colwise(site: Site):
    """Hidden columns split; each rank looks up its slice of every vector, the slices are gathered whole."""
    if not isinstance(site.target, nn.Embedding):
        raise site.refuse(f"applies to an nn.Embedding, not a {type(site.target).__name__}")
    _untied(site)
    return HiddenParallelEmbedding.from_dense(site.target, site.grid)


def kept_whole(site: Site) -> None:
    """`sequence_parallel`: a norm (or dropout) that transformers runs on this rank's slice of the sequence sees the
    whole sequence here and computes its whole gradient: kept whole, no collective. `replicate` and `local_params`:
    every rank keeps the full parameter (Sluice's shards are plain local tensors already, sharded by their own plan
    entries). `replicated_with_grad_allreduce`: kept whole here; its gradient sum is a hook
    (`tensor_pass.sync_replicated_grads`), registered once the weights have storage."""
    return None


class _Wrapped:
    """A module's forward with a transform on its way in or out (a class, not a closure, so deepcopy rebinds it)."""

    def __init__(self, forward: Callable, enter: Callable | None = None, leave: Callable | None = None):
        self.forward, self.enter, self.leave = forward, enter, leave

    def __call__(self, *args, **kwargs):
        if self.enter is not None:
            args, kwargs = self.enter(args, kwargs)
        out = self.forward(*args, **kwargs)
        return out if self.leave is None or out is None else self.leave(out)


def _module(site: Site) -> nn.Module:
    if isinstance(site.target, nn.Parameter):
        raise site.refuse("wraps a module's forward; a bare parameter has none (plan its owner)")
    return site.target


class _EnterRegion:
    """Every floating input enters the TP region (its gradient, partial on each rank, is summed in backward)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def enter(x):
            return copy_to_tp_region(x, self.group) if torch.is_tensor(x) and x.is_floating_point() else x

        return tuple(enter(a) for a in args), {k: enter(v) for k, v in kwargs.items()}


class _Sum:
    """The module's partial output summed over TP (all-reduce forward, identity backward)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp_region(out, self.group)


def moe_tp_experts(site: Site) -> None:
    """A module of stacked experts whose parameters are planned colwise / packed_colwise / rowwise: its floating
    inputs enter the TP region, each rank runs its slice of every expert, the partial outputs are summed."""
    module = _module(site)
    module.forward = _Wrapped(module.forward, _EnterRegion(site.grid.tp_group), _Sum(site.grid.tp_group))


def all_reduce(site: Site) -> None:
    """A module whose output is partial on each rank (it runs on sharded inputs or weights): the output is summed."""
    module = _module(site)
    module.forward = _Wrapped(module.forward, leave=_Sum(site.grid.tp_group))


class _DivideFirst:
    """The first input divided by tp (a value every rank holds whole, about to be summed over TP)."""

    def __init__(self, tp: int):
        self.tp = tp

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (args[0] / self.tp, *args[1:]), kwargs


def moe_identity_expert(site: Site) -> None:
    """An identity expert (LongCat's zero experts) inside `moe_tp_experts`, whose output every rank computes whole
    and the experts' sum then adds tp times: its input is divided by tp first (its gradient alike)."""
    module = _module(site)
    module.forward = _Wrapped(module.forward, enter=_DivideFirst(site.grid.tp))


class _RopeGradSum:
    """MLA's kv_a projection output [pass | rope]: the rope part goes to attention on this rank's heads, so its
    gradient is partial and is summed over TP; the pass part's is summed by the colwise kv_b projection it feeds."""

    def __init__(self, rope_dim: int, group):
        self.rope_dim, self.group = rope_dim, group

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        kept, rope = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([kept, copy_to_tp_region(rope, self.group)], dim=-1)


def mla_kv_a_proj(site: Site) -> None:
    """DeepSeek-V2-style MLA's `kv_a_proj_with_mqa`, kept whole: the gradient of its rope part is summed over TP."""
    module = _module(site)
    rope_dim = getattr(site.config, "qk_rope_head_dim", None)
    if not isinstance(rope_dim, int):
        raise site.refuse("needs qk_rope_head_dim on the model config, which it lacks")
    module.forward = _Wrapped(module.forward, leave=_RopeGradSum(rope_dim, site.grid.tp_group))


STYLES: MappingProxyType[str, Builder] = MappingProxyType({  # style -> builder: how it maps onto replicated activations
    "colwise": colwise,  # output rows split, output stays sharded (a region's start)
    "colwise_gather_output": colwise_gather_output,  # output rows split, output gathered whole
    "colwise_rep": colwise_gather_output,  # transformers: input and output Replicate, i.e. gathered
    "rowwise": rowwise,  # input columns split, sharded input, output summed (a region's end)
    "rowwise_split_input": rowwise_split_input,  # whole input sliced to this rank's block, then rowwise
    "rowwise_rep": rowwise_split_input,  # transformers: input Replicate -> Shard(-1), output Replicate
    "packed_colwise": packed_colwise,  # colwise within each packed part (sizes from the adapter's tp_parts)
    "packed_rowwise": packed_rowwise,  # rowwise within each packed part
    "embedding_rowwise": embedding_rowwise,  # vocabulary rows split, lookups summed
    "embedding_colwise": embedding_colwise,  # hidden columns split, lookups gathered
    "sequence_parallel": kept_whole,  # sees the whole sequence here: whole gradient, nothing to do
    "replicated_with_grad_allreduce": kept_whole,  # kept whole; its gradient summed by a hook (GRAD_SUMMED)
    "replicate": kept_whole,  # every rank keeps the full parameter
    "local_params": kept_whole,  # Sluice's shards are local tensors already
    "moe_tp_experts": moe_tp_experts,  # inputs enter the region, partial outputs summed
    "moe_identity_expert": moe_identity_expert,  # input divided by tp before the experts' sum
    "all_reduce": all_reduce,  # partial output summed
    "mla_kv_a_proj": mla_kv_a_proj,  # kept whole; the rope part's gradient summed
})
GRAD_SUMMED = ("replicated_with_grad_allreduce",)  # styles whose kept parameters sum their gradient over TP


def unknown_styles(plan: dict[str, str]) -> list[tuple[str, str]]:
    """(module or parameter pattern, style) of each plan entry whose style has no builder."""
    return [(key, style) for key, style in plan.items() if style not in STYLES]
