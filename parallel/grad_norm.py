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
        if param.grad is not None:
            sum_sq += param.grad.detach().double().pow(2).sum()
    return all_reduce_(sum_sq, group).sqrt()


def scale_grads_(params: list[nn.Parameter], scale: float) -> None:
    """Multiply every gradient in place (clipping)."""
    for param in params:
        if param.grad is not None:
            param.grad.mul_(scale)
