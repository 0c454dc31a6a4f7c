"""Collective helpers that are no-ops without peers (group None or of size 1)."""

from typing import Any

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in group; 1 for None."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index inside group; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup | None,
                op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over group; returns tensor."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather_cat(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's tensor along dim, in group-rank order (not differentiable)."""
    if group_size(group) == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(group_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: Any, group: dist.ProcessGroup | None, src: int) -> Any:
    """Return the picklable obj of global rank src on every rank of group."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
