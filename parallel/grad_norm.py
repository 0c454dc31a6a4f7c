"""The global gradient norm across the whole grid, with each unique parameter counted exactly once."""

from __future__ import annotations

import torch
from torch import nn

from parallel.collectives import all_reduce_


# The norm is taken in float64 (a float32 norm drifts: 6e-4 relative over 16M elements, and a bf16 run
# amplifies any drift between layouts). On CPU piece by piece: a float64 copy of a whole gradient costs more
# than the norm itself, one of at most this many elements stays in cache. (A GPU's foreach kernel upcasts
# as it reads; there, pieces would only multiply the tensors in the call.)
CPU_NORM_PIECE = 1 << 16


def global_grad_norm(norm_params: list[nn.Parameter], group, device: torch.device) -> torch.Tensor:
    """L2 norm over `norm_params` summed over `group`, as a float64 tensor on the compute `device`.

    The accumulator lives on `device` even when this rank holds no gradient (NCCL cannot reduce CPU tensors)."""
    grads = [param.grad.detach() for param in norm_params if param.grad is not None]
    pieces = [p for g in grads for p in g.reshape(-1).split(CPU_NORM_PIECE)] if device.type == "cpu" else grads
    sum_sq = torch.zeros((), dtype=torch.float64, device=device)
    if pieces:  # one foreach call, as torch.nn.utils.clip_grad_norm_ makes, not a Python loop over parameters
        sum_sq += torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).square().sum()
    return all_reduce_(sum_sq, group).sqrt()


def scale_grads_(params: list[nn.Parameter], scale: torch.Tensor) -> None:
    """Multiply every gradient in place by the 0-dim `scale` (clipping), batched per device and dtype, as
    torch.nn.utils.clip_grad_norm_ does: the scale stays on the device (no host read), cast to the gradient's dtype
    as a Python float scale would be."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_kind.setdefault((param.grad.device, param.grad.dtype), []).append(param.grad)
    for (device, dtype), grads in by_kind.items():
        torch._foreach_mul_(grads, scale.to(device, dtype))
