"""AdamW, the warm-up + cosine learning-rate schedule, and grad-norm clipping across the whole grid."""

from __future__ import annotations

import math
from collections.abc import Iterable, MutableMapping

import torch
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from parallel.collectives import group_size
from parallel.expert import is_expert
from parallel.grad_norm import global_grad_norm, scale_grads_


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: DictConfig, dp_group=None, zero: int = 0,
                    edp_group=None) -> torch.optim.Optimizer | OptimizerSet:
    """AdamW with weight decay on matrices only (norm scales are not decayed); `zero=1` shards its state over the
    data-parallel group, and the state of EP-split experts over `edp_group`, the DP ranks holding the same ones.
    At `zero=2/3` the parameters are FSDP's shards already (`parallel.fsdp`): a plain AdamW steps each rank's own."""
    params = [p for p in params if p.requires_grad]
    experts = [p for p in params if is_expert(p)]
    if zero == 1 and experts:  # ZeRO shards whole parameters that every rank of its group holds: two groups, two parts
        dense = [p for p in params if not is_expert(p)]
        return OptimizerSet([_adamw(dense, cfg, dp_group, zero), _adamw(experts, cfg, edp_group, zero)])
    return _adamw(params, cfg, dp_group, zero)


def _adamw(params: list[torch.nn.Parameter], cfg: DictConfig, group, zero: int) -> torch.optim.Optimizer:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if zero >= 2:  # FSDP's shards (DTensors) and the parameters it keeps whole step in separate foreach calls
        groups = [{**g, "params": [p for p in g["params"] if isinstance(p, DTensor) is sharded]}
                  for g in groups for sharded in (True, False)]
    groups = [g for g in groups if g["params"]]  # experts are all matrices: no empty group for ZeRO to partition
    options = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kernel(params))
    if zero == 1 and group_size(group) > 1:
        # ZeRO-1 with torch's own ZeroRedundancyOptimizer: each rank of `group` keeps the AdamW state of whole
        # parameters (greedy by size) and broadcasts them after its step. Gradients stay fully summed on every rank,
        # so the global norm and clipping are exact, and AdamW is element-wise, so the numbers equal zero=0.
        # Parameters as views of one bucket per rank: one broadcast per rank instead of one per parameter (a zero1
        # step's AdamW + broadcasts at h256-l4 on gloo: 37 -> 24 ms); its bucket has one dtype, so only then.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        one_dtype = len({(p.dtype, p.device) for p in params}) == 1
        optimizer = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, process_group=group,
                                            parameters_as_bucket_view=one_dtype, **options)
        local = optimizer.optim
    else:
        optimizer = local = torch.optim.AdamW(groups, **options)
    if options.get("fused"):
        local.register_step_pre_hook(prepare_fused_step)
    return optimizer


def kernel(params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """AdamW's implementation: torch's fused kernel on CUDA and CPU (one pass over each parameter instead of a dozen
    element-wise ops: 4.4 against 17 ms at 4.8M parameters on one CPU thread; the loop torch picks by default on CPU
    is what DDP's user gets). It is exact in every layout; against the loop it rounds about 2% of elements one ulp
    apart, which a bf16 run can carry into a flipped cast: the suite compares bf16 at tolerances derived from bf16
    and runs its Qwen3 bf16 case under both kernels (tests/test_families.py), so neither kernel decides a verdict."""
    if params and all(p.device.type in ("cuda", "cpu") for p in params):
        return {"fused": True}
    return {"foreach": False}


def prepare_fused_step(optimizer: torch.optim.Optimizer, *_) -> None:
    """Before a fused step: each gradient made contiguous, and a resumed `step` count (loaded as a host scalar) moved to
    its parameter's device as float32, where the fused kernel reads it; a no-op once so. The fused kernel walks a
    gradient in memory order: given a non-contiguous one (a transposed or recomputed view), torch 2.13's CPU kernel
    pairs the wrong elements (a transposed 300x70 gradient: 4e-3 relative error in five steps; tests/test_gpu_ready.py);
    contiguous, the fused kernel sees what the loop sees."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and not param.grad.is_contiguous():
                param.grad = param.grad.contiguous()
            step = optimizer.state.get(param, {}).get("step")
            if step is not None and (step.device != param.device or step.dtype != torch.float32):
                optimizer.state[param]["step"] = step.to(param.device, torch.float32)


class OptimizerSet:
    """Optimizers over disjoint parameters, stepped as one (ZeRO-1 under EP: dense state sharded over DP, expert
    state over the edp group). `optim` is this rank's state as one optimizer, as ZeroRedundancyOptimizer's is."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts
        self.optim = LocalStates([getattr(part, "optim", part) for part in parts])

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


class LocalStates:
    """Several local optimizers seen as one: their param groups, and a `state` that reads and writes each
    parameter's entry in the optimizer that holds it (what a checkpoint saves and loads)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.param_groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        self.state = _RoutedState({id(p): optimizer for optimizer in optimizers
                                   for group in optimizer.param_groups for p in group["params"]})


class _RoutedState(MutableMapping):
    def __init__(self, holders: dict[int, torch.optim.Optimizer]):
        self.holders = holders

    def _holder(self, param: torch.nn.Parameter) -> torch.optim.Optimizer:
        if id(param) not in self.holders:
            raise KeyError(param)
        return self.holders[id(param)]

    def __getitem__(self, param):
        return self._holder(param).state[param]

    def __setitem__(self, param, value) -> None:
        self._holder(param).state[param] = value

    def __delitem__(self, param) -> None:
        del self._holder(param).state[param]

    def __iter__(self):
        seen = {id(o): o for o in self.holders.values()}
        return (param for optimizer in seen.values() for param in list(optimizer.state))

    def __len__(self) -> int:
        return sum(1 for _ in self)


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
                   max_norm: float, group, device: torch.device) -> torch.Tensor:
    """Global L2 grad norm over `norm_params` (each unique parameter counted by exactly one rank), summed over
    `group`, as a float64 tensor on `device`; all of `all_params` are scaled when it exceeds max_norm (0 = no
    clipping). Decided on the device, as torch's clip_grad_norm_ does: no host read (the step's vote reads it)."""
    norm = global_grad_norm(norm_params, group, device)
    if max_norm > 0:
        # x * 1.0 is exact, so an unclipped step keeps its gradients bit for bit; a NaN norm compares False.
        scale_grads_(all_params, torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0))
    return norm
