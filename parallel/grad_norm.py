"""The global gradient norm across the whole grid, with each unique parameter counted exactly once."""

from __future__ import annotations

import torch
from torch import nn

from parallel.collectives import all_reduce_


# Per-piece norms are taken in float32 over pieces of at most this many elements, then squared and summed in
# float64: one float32 norm over a large tensor drifts (6e-4 relative at 16M elements), over 64K it stays near
# 1e-7, and a float64 copy of every gradient costs three times as much as the whole foreach norm.
NORM_PIECE = 1 << 16


def global_grad_norm(norm_params: list[nn.Parameter], group, device: torch.device) -> torch.Tensor:
    """L2 norm over `norm_params` summed over `group`, as a float64 tensor on the compute `device`.

    The accumulator lives on `device` even when this rank holds no gradient (NCCL cannot reduce CPU tensors)."""
    pieces = [piece for param in norm_params if param.grad is not None
              for piece in param.grad.detach().reshape(-1).split(NORM_PIECE)]
    sum_sq = torch.zeros((), dtype=torch.float64, device=device)
    if pieces:  # one foreach call, as torch.nn.utils.clip_grad_norm_ makes, not a Python loop over parameters
        sum_sq += torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float32)).double().square().sum()
    return all_reduce_(sum_sq, group).sqrt()


def scale_grads_(params: list[nn.Parameter], scale: float) -> None:
    """Multiply every gradient in place (clipping), batched per device and dtype."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale)  # what torch.nn.utils.clip_grad_norm_ itself uses
