"""The global gradient norm across the whole grid, with each unique parameter counted exactly once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from parallel.collectives import all_reduce_


# The norm is taken in float64 (a float32 norm drifts: 6e-4 relative over 16M elements, and a bf16 run
# amplifies any drift between layouts). On CPU piece by piece: a float64 copy of a whole gradient costs more
# than the norm itself, one of at most this many elements stays in cache. (A GPU's foreach kernel upcasts
# as it reads; there, pieces would only multiply the tensors in the call.)
CPU_NORM_PIECE = 1 << 16


def global_grad_norm(norm_params: list[nn.Parameter], group, device: torch.device) -> torch.Tensor:
    """L2 norm over `norm_params` summed over `group`, as a float64 tensor on the compute `device`.

    The accumulator lives on `device` even when this rank holds no gradient (NCCL cannot reduce CPU tensors).
    A sharded gradient (FSDP's DTensor) counts its local shard, summed first over the ranks sharing it."""
    whole = [param.grad.detach() for param in norm_params if param.grad is not None
             and not isinstance(param.grad, DTensor)]
    sum_sq = _sum_sq(whole, device)
    for mesh, (placements, grads) in _by_shard_mesh(norm_params).items():  # the same order on every peer
        part = _sum_sq(grads, device)
        for dim, placement in enumerate(placements):
            if isinstance(placement, Shard) and not _within(mesh.get_group(dim), group):
                part = all_reduce_(part, mesh.get_group(dim))  # the shards' sum, then counted as a whole parameter
        sum_sq = sum_sq + part
    return all_reduce_(sum_sq, group).sqrt()


def _within(shards, group) -> bool:
    """Whether every rank of `shards` is in `group` too: its shards are then summed by the norm's own all-reduce
    (each counted by the rank holding it: the dense shards at ep = dp, see `rank_grads.norm_parameters`)."""
    if group is None:
        return False
    return set(dist.get_process_group_ranks(shards)) <= set(dist.get_process_group_ranks(group))


def _sum_sq(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The float64 sum of squares of `grads` (local shards of DTensors), on `device`."""
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    pieces = [p for g in grads for p in g.reshape(-1).split(CPU_NORM_PIECE)] if device.type == "cpu" else grads
    sum_sq = torch.zeros((), dtype=torch.float64, device=device)
    if pieces:  # one foreach call, as torch.nn.utils.clip_grad_norm_ makes, not a Python loop over parameters
        sum_sq += torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).square().sum()
    return sum_sq


def _by_shard_mesh(params: list[nn.Parameter]) -> dict[object, tuple[tuple, list[torch.Tensor]]]:
    """Sharded gradients by their mesh, in the order of first appearance; a sharded parameter without a gradient
    (none reached it this step) still names its mesh, so every rank of a mesh joins its all-reduce."""
    out: dict = {}
    for param in params:
        if isinstance(param, DTensor):
            _, grads = out.setdefault(param.device_mesh, (param.placements, []))
            if param.grad is not None:
                grads.append(param.grad.detach())
    return out


def scale_grads_(params: list[nn.Parameter], scale: torch.Tensor) -> None:
    """Multiply every gradient in place by the 0-dim `scale` (clipping), batched per device and dtype, as
    torch.nn.utils.clip_grad_norm_ does: the scale stays on the device (no host read), cast to the gradient's dtype
    as a Python float scale would be."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:  # a sharded gradient scales its local shard, in place
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), grads in by_kind.items():
        torch._foreach_mul_(grads, scale.to(device, dtype))
