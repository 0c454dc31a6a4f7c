"""From a composed config to running workers: in-process, under torchrun, or self-launched locally."""

import logging
import os
import sys
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from parallel.collectives import broadcast_object
from training.cluster import is_launch_leader, node_launch, omp_threads
from training.config import CONF_DIR, ConfigError, validate
from training.console import check_run_dir, quiet_progress_bars
from training.layout import layout_world_size, process_pp

log = logging.getLogger("sluice")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    """Hydra task: one run (or one job of a sweep)."""
    run(cfg, Path(HydraConfig.get().runtime.output_dir))


def under_torchrun() -> bool:
    """True when a launcher (torchrun, the elastic agent, srun+torchrun) already started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run(cfg: DictConfig, run_dir: Path) -> None:
    """Validate, then train here (one process or torchrun rank) or start the local workers."""
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else layout_world_size(cfg)
    try:
        validate(cfg, world_size)
        if is_launch_leader(os.environ) and (problem := check_run_dir(run_dir, cfg.checkpoint.resume)):
            raise ConfigError(problem)
    except ConfigError as error:
        print(f"sluice: config error: {error}", file=sys.stderr)
        sys.exit(2)
    if under_torchrun() or world_size == 1:
        run_worker(OmegaConf.to_container(cfg, resolve=True), str(run_dir))
    else:
        self_launch(cfg, world_size, run_dir)


def run_worker(cfg_dict: dict, run_dir: str) -> list[float]:
    """Body of every rank: grid, trainer, loop, clean shutdown. Returns the per-step losses."""
    from parallel.grid import ParallelGrid
    from training.trainer import Trainer

    cfg = OmegaConf.create(cfg_dict)
    p = cfg.parallel
    try:  # the grid too: a failure after the rendezvous must still destroy the process group
        if not under_torchrun():
            grid = ParallelGrid.single()
        else:
            grid = ParallelGrid.build(p.dp, p.tp, process_pp(cfg), backend=p.backend, timeout_s=p.timeout_s)
        run_dir = agree_on_run_dir(run_dir, grid)
        configure_worker_logging(Path(run_dir), grid.rank)
        quiet_progress_bars(grid.rank)
        losses = Trainer(cfg, grid, Path(run_dir)).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return losses


def configure_worker_logging(run_dir: Path, rank: int) -> None:
    """Self-launched workers start without Hydra's logging: rank 0 appends to the run's train.log."""
    root = logging.getLogger()
    if root.handlers or rank != 0:
        return  # Hydra configured this process already, or this rank stays quiet
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def agree_on_run_dir(run_dir: str, grid) -> str:
    """Under torchrun each rank ran Hydra; rank 0's output directory is the run's one directory."""
    return broadcast_object(run_dir, None if grid.world_size == 1 else dist.group.WORLD, src=0)


def self_launch(cfg: DictConfig, world_size: int, run_dir: Path) -> None:
    """Start world_size local workers through the torchrun launcher API and wait for all of them."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    node = node_launch(world_size, os.environ)  # this node's share under a multi-node submitit job
    os.environ.setdefault("OMP_NUM_THREADS", str(omp_threads(node.nproc_per_node)))  # workers inherit it
    config = LaunchConfig(
        min_nodes=node.nnodes, max_nodes=node.nnodes, nproc_per_node=node.nproc_per_node, run_id=node.run_id,
        rdzv_backend="c10d", rdzv_endpoint=node.rdzv_endpoint, max_restarts=0, monitor_interval=0.1,
        start_method="spawn",
    )
    log.info("launching %d local workers (dp*tp*pp) into %s", world_size, run_dir)
    try:
        elastic_launch(config, entrypoint=run_worker)(OmegaConf.to_container(cfg, resolve=True), str(run_dir))
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
        first_line = str(message).strip().splitlines()[-1] if message else f"exit code {failure.exitcode}"
        print(f"sluice: worker rank {rank} failed: {first_line} (the other workers were stopped)", file=sys.stderr)
        sys.exit(1)
