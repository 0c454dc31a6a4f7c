"""The layout's process count from the config: "pipeline ranks per process", the world-size rule's caller, and the
CPU threads a worker gets."""

import os

from omegaconf import DictConfig

from parallel.spec import resolve_dp
from training.rules.values import ConfigError


def process_pp(cfg: DictConfig) -> int:
    """Pipeline ranks that are separate processes: 1 under emulation (one process plays the whole pipeline)."""
    return 1 if cfg.parallel.emulate else cfg.parallel.pp


def layout_world_size(cfg: DictConfig, launched: int | None = None) -> int:
    """Processes the layout needs, dp * tp * process_pp; checked against `launched` when a launcher chose it.
    Without a launcher an unset parallel.dp means 1; under one, `parallel.spec.resolve_dp` (the rule's one home, shared
    with the grid) derives it and refuses a world it does not fit."""
    p, pp = cfg.parallel, process_pp(cfg)
    if launched is None:
        return (p.dp or 1) * p.tp * pp
    try:
        resolve_dp(launched, p.dp, p.tp, pp)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return launched


def resolved_dp(cfg: DictConfig, launched: int | None = None) -> int:
    """The data-parallel size the run will have (parallel.dp, else what the launched world leaves, else 1)."""
    p = cfg.parallel
    if launched is None or p.dp is not None:
        return p.dp or 1
    return resolve_dp(launched, None, p.tp, process_pp(cfg))


def resolve_global_batch(cfg: DictConfig, launched: int | None = None) -> None:
    """Set schedule.n_microbatches from train.global_batch_size (sequences per optimizer step), when that is set. As in
    Megatron-LM the global batch wins: n_microbatches = global_batch_size / (dp * micro_batch_size)."""
    t = cfg.train
    if t.global_batch_size is None:
        return
    dp = resolved_dp(cfg, launched)
    per_microbatch = dp * t.micro_batch_size
    if t.global_batch_size % per_microbatch:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not a multiple of dp {dp} x "
                          f"train.micro_batch_size {t.micro_batch_size} = {per_microbatch}; change one of them")
    cfg.schedule.n_microbatches = t.global_batch_size // per_microbatch


def omp_threads(nproc_per_node: int) -> int:
    """CPU threads per worker when the user set none: the cores this process may use, shared out evenly."""
    return max(1, len(os.sched_getaffinity(0)) // nproc_per_node)
