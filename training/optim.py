"""AdamW, the warm-up + cosine learning-rate schedule, and grad-norm clipping across the whole grid."""

import math
from collections.abc import Iterable

import torch
from omegaconf import DictConfig

from parallel.collectives import group_size
from parallel.grad_norm import global_grad_norm, scale_grads_


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: DictConfig, dp_group=None,
                    zero: int = 0) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm scales are not decayed); `zero=1` shards its state
    over the data-parallel group."""
    decay, no_decay = [], []
    for param in params:
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False keeps the update order identical whatever the parameter grouping of a layout.
    options = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=False)
    if zero and group_size(dp_group) > 1:
        # ZeRO-1 with torch's own ZeroRedundancyOptimizer: each DP rank keeps the AdamW state of whole parameters
        # (greedy by size) and broadcasts them after its step. Gradients stay fully summed on every rank, so the
        # global norm and clipping are exact, and AdamW is element-wise, so the numbers equal zero=0.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, torch.optim.AdamW, process_group=dp_group, **options)
    return torch.optim.AdamW(groups, **options)


def lr_at(step: int, total_steps: int, cfg: DictConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.min_lr_ratio * cfg.lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    span = max(total_steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Apply one learning rate to every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(all_params: list[torch.nn.Parameter], norm_params: list[torch.nn.Parameter],
                   max_norm: float, group, device: torch.device) -> float:
    """Global L2 grad norm over `norm_params` (each unique parameter counted by exactly one rank),
    summed over `group`; all of `all_params` are scaled when it exceeds max_norm (0 = no clipping)."""
    norm = float(global_grad_norm(norm_params, group, device))  # the step's one read of the norm
    if max_norm > 0 and norm > max_norm:
        scale_grads_(all_params, max_norm / (norm + 1e-6))
    return norm
