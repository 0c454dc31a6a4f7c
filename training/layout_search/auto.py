"""`parallel.layout=auto`: search the layouts of the launched world on measured costs and run the best one."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from parallel.collectives import broadcast_object
from parallel.grid import resolve_backend
from training.layout_search.predict import Candidate
from training.layout_search.profile import measured_costs
from training.layout_search.search import apply_candidate, search
from training.layout_search.search_report import chosen, no_fit_message
from training.rules.values import ConfigError


def choose(cfg: DictConfig, world_size: int) -> tuple[Candidate, str]:
    """The fastest candidate within the budget and the line announcing it; ConfigError when none fits."""
    costs = measured_costs(cfg, world_size)
    result = search(cfg, world_size, costs)
    if result.best is None:
        raise ConfigError(no_fit_message(result, cfg, costs))
    return result.best.candidate, f"parallel.layout=auto chose {chosen(result.best)}"


def choose_layout(cfg: DictConfig, world_size: int) -> DictConfig:
    """The config with the chosen layout applied (and parallel.layout cleared); prints what was chosen."""
    candidate, line = choose(cfg, world_size)
    print(f"sluice: {line}", flush=True)
    return apply_candidate(cfg, candidate)


def agree_on_layout(cfg: DictConfig, rank: int, store: dist.Store | None = None) -> DictConfig:
    """Under torchrun: rank 0 chooses and every rank applies its choice, so no two ranks run different layouts. Joins
    the default process group (the grid reuses it); a rank-0 failure reaches every rank as its message."""
    backend, device = resolve_backend(cfg.parallel.backend)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        where = {"init_method": "env://"} if store is None else {  # store: this start's own (training/rendezvous)
            "store": store, "rank": rank, "world_size": int(os.environ["WORLD_SIZE"])}
        dist.init_process_group(backend, **where,  # peers may still be importing: start-up bound
                                timeout=timedelta(seconds=max(cfg.parallel.timeout_s, cfg.parallel.startup_timeout_s)))
    decision: tuple[Candidate | None, str] = (None, "")
    if rank == 0:
        try:
            decision = choose(cfg, dist.get_world_size())
            print(f"sluice: {decision[1]}", flush=True)
        except Exception as error:  # any failure, not only a config error: the others wait on this broadcast
            decision = (None, str(error) if isinstance(error, ConfigError) else f"parallel.layout=auto failed on "
                        f"rank 0: {type(error).__name__}: {error}")
    candidate, message = broadcast_object(decision, dist.group.WORLD, src=0)
    if candidate is None:
        raise ConfigError(message)
    return apply_candidate(cfg, candidate)
