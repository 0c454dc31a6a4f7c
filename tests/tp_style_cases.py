"""Each TP style of `parallel.tensor_styles.STYLES` on a toy module, run inside a TP worker (the tp2 spawn of
tests/test_tensor_parallel.py) against the same module whole: output, input gradient and the parameters' gradients
(joined over TP)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from parallel.blocks import join_blocks
from parallel.collectives import group_rank
from parallel.grid import ParallelGrid
from parallel.tensor import copy_to_tp_region
from parallel.tensor_styles import STYLES, Site

PARTS = (6, 2, 2)  # [q | k | v] rows under GQA: unequal packed parts
STYLE_CASES = {  # case -> the styles it runs (every entry of STYLES has one)
    "colwise+rowwise": ("colwise", "rowwise"),
    "colwise_gather_output+rowwise_split_input": ("colwise_gather_output", "rowwise_split_input"),
    "colwise_rep+rowwise_rep": ("colwise_rep", "rowwise_rep"),
    "packed_colwise+packed_rowwise by parts": ("packed_colwise", "packed_rowwise"),
    "packed_colwise+packed_rowwise by halves": ("packed_colwise", "packed_rowwise"),
    **{style: (style,) for style in ("embedding_rowwise", "embedding_colwise", "sequence_parallel", "replicate",
                                     "local_params", "replicated_with_grad_allreduce", "all_reduce",
                                     "moe_identity_expert", "mla_kv_a_proj", "moe_tp_experts")},
}


class _Parts:
    """An adapter stand-in: the packed parts of every planned target."""

    def __init__(self, parts: tuple[int, ...] | None):
        self.parts = parts

    def tp_parts(self, name: str) -> tuple[int, ...] | None:
        return self.parts


def _apply(module: nn.Module, plan: dict[str, str], grid: ParallelGrid, parts=None, config=None) -> nn.Module:
    """`module` (a copy) with each planned child replaced or wrapped by its style's builder."""
    module, ties = copy.deepcopy(module), {}
    for name, style in plan.items():
        site = Site(name, module.get_submodule(name), style, grid, _Parts(parts), config or SimpleNamespace(), ties)
        built = STYLES[style](site)
        if built is not None:
            setattr(module, name, built)
    return module


def _joined(param: nn.Parameter, grid: ParallelGrid) -> torch.Tensor:
    """The dense gradient of a (maybe sharded) parameter."""
    if not getattr(param, "tensor_parallel", False):
        return param.grad
    blocks = [torch.empty_like(param.grad) for _ in range(grid.tp)]
    dist.all_gather(blocks, param.grad.contiguous(), group=grid.tp_group)
    return join_blocks(blocks, param.partition_dim, getattr(param, "tp_packed", 1))


def _error(dense: nn.Module, sharded: nn.Module, x: torch.Tensor, grid: ParallelGrid,
           weigh: Callable[[torch.Tensor], torch.Tensor] = lambda y: y) -> float:
    """Largest error, relative to the dense tensor's scale, of output, input gradient and parameter gradients."""
    errors, grads = [], []
    for model in (copy.deepcopy(dense), sharded):  # a copy: the toys serve several cases
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        (weigh(out) ** 2).sum().backward()
        grads.append((out.detach(), xi.grad, {n: _joined(p, grid) for n, p in model.named_parameters()}))
    (out_d, gx_d, gp_d), (out_s, gx_s, gp_s) = grads
    pairs = [(out_s, out_d), *([(gx_s, gx_d)] if gx_d is not None else []), *((gp_s[n], gp_d[n]) for n in gp_d)]
    for got, want in pairs:
        errors.append(((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
                      if got.shape == want.shape else float("inf"))
    return max(errors)


class _PartialOut(nn.Module):
    """A module whose output is this rank's share (rank r: x * (r + 1)); whole, it is the sum over ranks."""

    def __init__(self, rank: int | None, tp: int):
        super().__init__()
        self.rank, self.tp = rank, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.rank + 1) if self.rank is not None else x * sum(range(1, self.tp + 1))


class _Enter(nn.Module):
    """The entry of a TP region: identity forward, the input gradient summed over TP backward."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tp_region(x, self.group)


class _Divided(nn.Module):
    """Whole: x / tp, what `moe_identity_expert` makes of an identity on each rank."""

    def __init__(self, tp: int):
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.tp


def style_errors(grid: ParallelGrid) -> dict[str, float]:
    """Per style (or pair of styles making one TP region): the relative error against the whole module."""
    torch.manual_seed(0)  # the same toys and inputs on every rank
    x, ids = torch.randn(2, 5, 8), torch.randint(0, 16, (2, 5))
    out: dict[str, float] = {}
    pair, packed = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8)), nn.Sequential(nn.Linear(8, 10), nn.Linear(10, 8))
    for case, (first, second) in list(STYLE_CASES.items())[:5]:
        module, parts = (packed, PARTS) if case.endswith("by parts") else (pair, None)
        out[case] = _error(module, _apply(module, {"0": first, "1": second}, grid, parts), x, grid)
    for style in ("embedding_rowwise", "embedding_colwise"):
        embed = nn.Sequential(nn.Embedding(16, 8))
        sharded = _apply(embed, {"0": style}, grid)
        out[style] = _error(_FromIds(embed), _FromIds(sharded), ids.float(), grid)
    norm = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    for style in ("sequence_parallel", "replicate", "local_params", "replicated_with_grad_allreduce"):
        out[style] = _error(norm, _apply(norm, {"1": style}, grid), x, grid)
    rank = group_rank(grid.tp_group)
    region = _apply(nn.Sequential(nn.Identity(), _PartialOut(rank, grid.tp)), {"1": "all_reduce"}, grid)
    region[0] = _Enter(grid.tp_group)  # the input enters a TP region first (set after the copy: a group won't copy)
    out["all_reduce"] = _error(nn.Sequential(nn.Identity(), _PartialOut(None, grid.tp)), region, x, grid)
    out["moe_identity_expert"] = _error(nn.Sequential(_Divided(grid.tp)),
                                        _apply(nn.Sequential(nn.Identity()), {"0": "moe_identity_expert"}, grid), x,
                                        grid)
    out.update(_mla_and_experts(grid, x, rank))
    return out


class _FromIds(nn.Module):
    """An embedding fed ids carried as floats (so that `_error` can hand it a tensor it differentiates)."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids.long())


def _mla_and_experts(grid: ParallelGrid, x: torch.Tensor, rank: int) -> dict[str, float]:
    """`mla_kv_a_proj` and `moe_tp_experts` (stacked experts' parameters planned colwise / rowwise)."""
    experts = _Experts()
    sharded_experts, ties = copy.deepcopy(experts), {}
    for name, style in {"w_in": "colwise", "w_out": "rowwise"}.items():
        param = getattr(sharded_experts, name)
        setattr(sharded_experts, name, STYLES[style](Site(name, param, style, grid, _Parts(None), None, ties)))
    STYLES["moe_tp_experts"](Site("experts", sharded_experts, "moe_tp_experts", grid, _Parts(None), None, ties))
    return {"mla_kv_a_proj": _mla_error(grid, x, rank), "moe_tp_experts": _error(experts, sharded_experts, x, grid)}


def _mla_error(grid: ParallelGrid, x: torch.Tensor, rank: int) -> float:
    """MLA's kv_a projection [pass (4) | rope (2)]: rank r's heads weigh the pass part by a[r] after a colwise
    layer's region entry, the rope part by b[r] directly; whole, the loss sums every rank's. Input and weight
    gradients must be whole on every rank."""
    kv_a = nn.Sequential(nn.Linear(8, 6))
    sharded = _apply(kv_a, {"0": "mla_kv_a_proj"}, grid, config=SimpleNamespace(qk_rope_head_dim=2))
    a, b = torch.randn(grid.tp, 4), torch.randn(grid.tp, 2)

    def loss(y: torch.Tensor, ranks: range, entered: bool) -> torch.Tensor:
        pass_part, rope = y.split([4, 2], dim=-1)
        if entered:
            pass_part = copy_to_tp_region(pass_part, grid.tp_group)
        return sum(((pass_part * a[r]) ** 2).sum() + ((rope * b[r]) ** 2).sum() for r in ranks)

    found = []
    for model, ranks, entered in ((kv_a, range(grid.tp), False), (sharded, range(rank, rank + 1), True)):
        xi = x.clone().requires_grad_(True)
        loss(model(xi), ranks, entered).backward()
        found.append([xi.grad, *(p.grad for p in model.parameters())])
    return max(((s - d).abs().max() / d.abs().max()).item() for s, d in zip(found[1], found[0]))


class _Experts(nn.Module):
    """Two stacked experts [E, out, in] run on every token (a stand-in for transformers' experts modules)."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(2, 12, 8) * 0.3)
        self.w_out = nn.Parameter(torch.randn(2, 8, 12) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(torch.relu(x @ self.w_in[e].T) @ self.w_out[e].T for e in range(2))
