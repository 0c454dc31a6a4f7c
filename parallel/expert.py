"""The EP pass: split each MoE layer's experts over the ep group and dispatch tokens to them with all_to_all.

Driven by the model's declared `base_model_ep_plan` (transformers' convention): the module under style
`ep_dispatch_experts` holds a layer's experts. Rank i of an ep group of size E keeps experts [i*n/E, (i+1)*n/E)
under their dense names: a list becomes a ModuleDict keyed by global expert id (as a pruned pipeline stack does),
stacked parameters [n, ...] keep that slice along dim 0 (marked `expert_block`); the router and everything else
stay replicated. Every rank routes its own tokens (the gate is replicated, so the
aux loss is one process's), sends each routed copy to the rank holding its expert (dropless: variable split sizes,
counts exchanged first), runs its local experts on what it receives, returns the outputs by the inverse all_to_all
and combines them with the routing weights in the model's order. Both all_to_alls are differentiable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .decoder import Decoder, set_submodule
from .grid import ParallelGrid
from .tensor_pass import plan_pattern

DISPATCH = "ep_dispatch_experts"  # the style of the module holding one layer's experts


def check_ep_divisibility(n_experts: int, dp: int, ep: int) -> None:
    """Raise ValueError naming the size that ep does not divide (the experts, then the DP size) and the choices."""
    for what, size in ((f"model.num_experts={n_experts}", n_experts), (f"the data-parallel size parallel.dp={dp}", dp)):
        if size % ep:
            choices = ", ".join(str(e) for e in range(1, min(n_experts, dp) + 1) if n_experts % e == 0 and dp % e == 0)
            raise ValueError(f"parallel.ep={ep} does not divide {what}; choose ep in {{{choices}}}")


@dataclass(frozen=True)
class Routing:
    """Where one rank's routed token copies go and come from in one dispatch (the bookkeeping, no tensors moved).

    A row is one (token, slot) pair, numbered token * top_k + slot."""

    order: torch.Tensor  # rows sorted by expert (stable): the send order
    send_counts: list[int]  # rows sent to each ep rank
    recv_counts: list[int]  # rows received from each ep rank
    by_expert: torch.Tensor  # received rows (source-major) regrouped expert-major
    expert_counts: list[int]  # received rows per local expert
    local_ids: torch.Tensor  # the local expert of each expert-major row (built on the device)


def routing_of(top_k_index: torch.Tensor, sent: torch.Tensor, received: torch.Tensor) -> Routing:
    """The Routing of `top_k_index` [T, k] (global expert ids), given `sent` [n_experts] (its rows per expert) and
    `received` [ep, local] (the rows each ep rank sends to each of this rank's local experts: `sent`, exchanged)."""
    order = torch.argsort(top_k_index.reshape(-1), stable=True)
    ep, local = received.shape
    # Split sizes are host ints: one read of both count vectors (a device sync on GPUs, the dispatch's only one).
    # The index tensors are built on the device from the same counts, sized by the host total (no read of their own).
    host = torch.cat([sent.reshape(-1), received.reshape(-1)]).tolist()
    sent_h, counts = host[:ep * local], host[ep * local:]
    expert_counts = [sum(counts[s * local + j] for s in range(ep)) for j in range(local)]
    total = sum(counts)
    local_ids = torch.repeat_interleave(torch.arange(local, device=received.device), received.sum(0),
                                        output_size=total)
    return Routing(order, [sum(sent_h[r * local:(r + 1) * local]) for r in range(ep)],
                   [sum(counts[s * local:(s + 1) * local]) for s in range(ep)], expert_major(received, total),
                   expert_counts, local_ids)


def expert_major(received: torch.Tensor, total: int) -> torch.Tensor:
    """Indices that regroup the `total` received rows expert by expert. They arrive source by source, each source's
    rows sorted by expert: block (s, j) of `received[s, j]` rows; expert-major order walks the blocks as (j, s)."""
    ep, local = received.shape
    sizes = received.reshape(-1)
    starts = sizes.cumsum(0) - sizes  # where block (s, j) begins among the received rows
    blocks = torch.arange(ep * local, device=received.device).view(ep, local).t().reshape(-1)
    moved = sizes[blocks]
    shift = starts[blocks] - (moved.cumsum(0) - moved)  # a block's first row minus its expert-major position
    return torch.repeat_interleave(shift, moved, output_size=total) + torch.arange(total, device=received.device)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; its backward is the reverse all_to_all of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows of `x` split by `send` to each rank of `group`; what arrives, split by `recv`, in rank order."""
    # gloo (checked on torch 2.13: uneven splits and empty parts) and NCCL both implement all_to_all_single.
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable variable-split all_to_all over `group` (rows of `x` along dim 0)."""
    return _AllToAll.apply(x, send, recv, group)


class ExpertDispatch:
    """`experts(tokens [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]` over the ep group: the
    signature of transformers' MoE experts module; `run_local(rows, counts, ids)` runs this rank's experts on rows
    grouped expert by expert (`counts` per expert on the host, `ids` each row's local expert on the device). (A class,
    not a closure, so that deepcopy rebinds it to the copy.)"""

    def __init__(self, run_local: Callable[[torch.Tensor, list[int], torch.Tensor], torch.Tensor], n_local: int,
                 grid: ParallelGrid):
        self.run_local, self.n_local, self.ep, self.group = run_local, n_local, grid.ep, grid.ep_group

    def __call__(self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        local = self.n_local
        sent = torch.bincount(top_k_index.reshape(-1), minlength=self.ep * local)
        received = _exchange(sent, [local] * self.ep, [local] * self.ep, self.group).view(self.ep, local)
        routing = routing_of(top_k_index, sent, received)
        k = top_k_index.shape[-1]
        rows = all_to_all(tokens[routing.order // k], routing.send_counts, routing.recv_counts, self.group)
        outputs = self.run_local(rows[routing.by_expert], routing.expert_counts, routing.local_ids)
        back = torch.empty_like(routing.by_expert)
        back[routing.by_expert] = torch.arange(len(back), device=back.device)
        returned = all_to_all(outputs[back], routing.recv_counts, routing.send_counts, self.group)
        weights = top_k_weights.reshape(-1)[routing.order, None]
        # One index_add in expert order adds each token's expert outputs in the order the model's loop does.
        return torch.zeros_like(tokens).index_add(0, routing.order // k, (returned * weights).to(tokens.dtype))


def _joined(out: torch.Tensor, rows: torch.Tensor, idle) -> torch.Tensor:
    """`out` also hanging on the parameters of experts that got no rows, so that every rank's backward reaches the
    same parameters (the model's own forward does the same). When nothing arrived, `out` is `rows * 0.0`: it still
    hangs on the received rows, or this rank's backward would skip the reverse of the dispatch all_to_all that its
    peers run, and the ep group would hang."""
    touch = sum((0.0 * p.sum() for p in idle), rows.new_zeros(()))
    return out + touch.to(out.dtype)


class ListedExperts:
    """The local experts of a module list (a ModuleDict keyed by global id), each on its contiguous rows."""

    def __init__(self, experts: nn.ModuleDict):
        self.experts = experts

    def __call__(self, rows: torch.Tensor, counts: list[int], ids: torch.Tensor) -> torch.Tensor:
        outputs, idle = [], []
        for expert, part in zip(self.experts.values(), rows.split(counts)):
            if part.shape[0]:
                outputs.append(expert(part))
            else:
                idle.extend(expert.parameters())
        return _joined(torch.cat(outputs) if outputs else rows * 0.0, rows, idle)


class StackedExperts:
    """The local slice of stacked experts (transformers' `[E, out, in]` parameters), run by the module's own forward
    on the rows with local expert ids and unit weights (x * 1.0 is exact, so the dispatcher's weighting is the
    model's), which keeps any TP wrapping of that forward."""

    def __init__(self, module: nn.Module, forward: Callable):
        self.module, self.forward = module, forward

    def __call__(self, rows: torch.Tensor, counts: list[int], ids: torch.Tensor) -> torch.Tensor:
        if not rows.shape[0]:
            return _joined(rows * 0.0, rows, self.module.parameters(recurse=False))
        return self.forward(rows, ids[:, None], torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device))


def expert_modules(decoder: Decoder) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module the EP plan marks as one layer's experts."""
    rules = [plan_pattern(key) for key, style in decoder.plan.ep_plan.items() if style == DISPATCH]
    return [(n, m) for n, m in list(decoder.module.named_modules()) if any(r.fullmatch(n) for r in rules)]


def check_expert_parallel(decoder: Decoder, dp: int, ep: int) -> None:
    """ValueError (one line, naming the keys) where `ep` cannot split this model's experts over `dp` DP ranks."""
    if ep == 1:
        return
    found = expert_modules(decoder)
    if not found:
        raise ValueError(f"parallel.ep={ep} splits the experts of MoE layers, and this model has none (a dense model: "
                         "see model.use_moe); set parallel.ep=1")
    for name, experts in found:
        check_ep_divisibility(expert_count(name, experts), dp, ep)


def _listed(experts: nn.Module) -> bool:
    return isinstance(experts, (nn.ModuleList, nn.ModuleDict))


def expert_count(name: str, experts: nn.Module) -> int:
    """How many experts a planned module holds: a list's length, or its stacked parameters' leading dim."""
    if _listed(experts):
        return len(experts)
    sizes = {p.shape[0] for p in experts.parameters(recurse=False)}
    if len(sizes) != 1:
        raise ValueError(f"parallel.ep: {name} ({type(experts).__name__}) is neither a list of experts nor "
                         f"parameters stacked along one expert dim (leading sizes {sorted(sizes)}); set parallel.ep=1")
    return sizes.pop()


def apply_expert_parallel(decoder: Decoder, grid: ParallelGrid) -> Decoder:
    """Keep this rank's share of every planned experts module (names dense) and dispatch tokens to it.

    Run after the TP pass (the experts' TP layers are already in place, on the meta device); the kept expert
    parameters are marked `expert_parallel`: their gradients are summed over the edp group, not all of DP."""
    if grid.ep == 1:
        return decoder
    check_expert_parallel(decoder, grid.dp, grid.ep)
    for name, experts in expert_modules(decoder):
        if _listed(experts):
            _split_list(decoder, name, experts, grid)
        else:
            _split_stacked(experts, expert_count(name, experts), grid)
    return decoder


def _split_list(decoder: Decoder, name: str, experts: nn.Module, grid: ParallelGrid) -> None:
    """Keep this rank's experts of a list as a ModuleDict keyed by global id; the block's forward hands its tokens
    to the dispatcher through the family adapter."""
    model = decoder.module
    items = list(experts.items()) if isinstance(experts, nn.ModuleDict) else list(enumerate(experts))
    per = len(items) // grid.ep
    first = grid.ep_rank * per
    kept = nn.ModuleDict({str(i): module for i, module in items[first:first + per]})
    for p in kept.parameters():
        p.expert_parallel = True
    set_submodule(model, name, kept)
    block_name = name.rpartition(".")[0]
    block = model.get_submodule(block_name)
    seam: Callable | None = decoder.adapter.moe_forward(block, ExpertDispatch(ListedExperts(kept), per, grid))
    if seam is None:
        raise ValueError(f"parallel.ep: {block_name} calls its experts itself and the family adapter gives no "
                         "forward that hands them to a dispatcher")
    block.forward = seam


def _split_stacked(experts: nn.Module, n_experts: int, grid: ParallelGrid) -> None:
    """Keep this rank's slice [first, first + per) of each stacked parameter (its TP marks kept, the slice noted
    in `expert_block` for materialising and checkpoints); the module's own call becomes the dispatcher."""
    per = n_experts // grid.ep
    first = grid.ep_rank * per
    for pname, param in list(experts.named_parameters(recurse=False)):
        local = nn.Parameter(param.detach()[first:first + per].clone(), param.requires_grad)
        local.__dict__.update(param.__dict__)
        local.expert_parallel, local.expert_block = True, (grid.ep_rank, grid.ep)
        setattr(experts, pname, local)
    if hasattr(experts, "num_experts"):  # transformers' stacked experts size their one_hot by it
        experts.num_experts = per
    experts.forward = ExpertDispatch(StackedExperts(experts, experts.forward), per, grid)


def is_expert(param: nn.Parameter) -> bool:
    """A parameter of an EP-split experts module: held by one rank of each ep group."""
    return getattr(param, "expert_parallel", False)
