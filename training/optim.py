"""AdamW, the warm-up + cosine learning-rate schedule, and grad-norm clipping across the whole grid."""

import math
from collections.abc import Iterable

import torch
from omegaconf import DictConfig

from parallel.collectives import all_reduce_


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: DictConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm scales are not decayed)."""
    decay, no_decay = [], []
    for param in params:
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False keeps the update order identical whatever the parameter grouping of a layout.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=False)


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
                   max_norm: float, group=None) -> float:
    """Global L2 grad norm over `norm_params` (each unique parameter counted by exactly one rank),
    summed over `group`; all of `all_params` are scaled when it exceeds max_norm (0 = no clipping)."""
    grads = [p.grad for p in norm_params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    sum_sq = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        sum_sq += grad.detach().double().pow(2).sum()
    all_reduce_(sum_sq, group)
    norm = float(sum_sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for param in all_params:
            if param.grad is not None:
                param.grad.mul_(scale)
    return norm
