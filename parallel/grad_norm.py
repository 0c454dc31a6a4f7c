"""The global gradient norm across the whole grid, with each unique parameter counted exactly once."""

from __future__ import annotations

import torch
from torch import nn

from parallel.collectives import all_reduce_


def global_grad_norm(norm_params: list[nn.Parameter], group, device: torch.device) -> torch.Tensor:
    """L2 norm over `norm_params` summed over `group`, as a float64 tensor on the compute `device`.

    The accumulator lives on `device` even when this rank holds no gradient (NCCL cannot reduce CPU tensors)."""
    sum_sq = torch.zeros((), dtype=torch.float64, device=device)
    for param in norm_params:
        if param.grad is not None:  # accumulated in float64 without a float64 copy of the gradient
            sum_sq += torch.linalg.vector_norm(param.grad.detach(), dtype=torch.float64).square()
    return all_reduce_(sum_sq, group).sqrt()


def scale_grads_(params: list[nn.Parameter], scale: float) -> None:
    """Multiply every gradient in place (clipping), batched per device and dtype."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale)  # what torch.nn.utils.clip_grad_norm_ itself uses
