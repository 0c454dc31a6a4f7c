"""From a composed config to running workers: in-process, under torchrun, or self-launched locally."""

import logging
import os
import shutil
import sys
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from parallel.collectives import broadcast_object
from parallel.hang import DUMP_DIR, Watch, read_dumps, summarize, watch_engine, watch_grid
from training.cluster import is_launch_leader, node_launch, omp_threads
from training.config import CONF_DIR, ConfigError, validate
from training.console import check_run_dir, quiet_progress_bars
from training.failures import FAILURE_DIR, describe_failure, first_failure, record_failure
from training.faults import FaultInjector
from training.layout import layout_world_size, process_pp
from training.watchdog import EXIT_INTERRUPTED, Limits, report_hang, start_watchdog

log = logging.getLogger("sluice")
SELF_LAUNCHED = "SLUICE_SELF_LAUNCHED"  # set for the workers of self_launch: their root reports failures


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
        if cfg.parallel.plan == "auto" and not under_torchrun():  # under torchrun the ranks agree in run_worker
            from training.planner.auto import plan_layout

            cfg = plan_layout(cfg, world_size)
        validate(cfg, world_size)
        if is_launch_leader(os.environ) and (problem := check_run_dir(run_dir, cfg.checkpoint.resume)):
            raise ConfigError(problem)
    except ConfigError as error:
        print(f"sluice: config error: {error}", file=sys.stderr)
        sys.exit(2)
    if under_torchrun() or world_size == 1:
        worker_main(OmegaConf.to_container(cfg, resolve=True), str(run_dir))
    else:
        self_launch(cfg, world_size, run_dir)


def worker_main(cfg_dict: dict, run_dir: str) -> list[float]:
    """A rank as a process: watchdog (timeouts, signals, launcher death) and failures as one line."""
    rank, launched = int(os.environ.get("RANK", 0)), under_torchrun()
    announce = os.environ.get(SELF_LAUNCHED) != "1"  # a self-launch root prints the first failure itself
    p = cfg_dict["parallel"]
    limits = Limits(float(p["timeout_s"]), float(p["startup_timeout_s"]))
    watch = Watch(rank, groups={"world": list(range(int(os.environ.get("WORLD_SIZE", 1))))})
    watch.run_dir = Path(run_dir)
    if launched:
        start_watchdog(watch, limits, announce)
    try:
        return run_worker(cfg_dict, run_dir, watch)
    except KeyboardInterrupt:
        print("sluice: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as error:
        if limits.exceeded(watch, 0.9):
            report_hang(watch, limits, announce)  # a wait that timed out (not a dead peer): the hang report
        else:
            where = watch.run_dir
            record_failure(where, rank, describe_failure(error, where, rank), announce)
        sys.exit(1)


def run_worker(cfg_dict: dict, run_dir: str, watch: Watch | None = None) -> list[float]:
    """Body of every rank: grid, trainer, loop, clean shutdown. Returns the per-step losses."""
    from parallel.grid import ParallelGrid
    from training.guard import StepGuard
    from training.trainer import Trainer

    cfg = OmegaConf.create(cfg_dict)
    p = cfg.parallel
    watch = watch if watch is not None else Watch(int(os.environ.get("RANK", 0)))
    faults = FaultInjector(OmegaConf.select(cfg, "debug.fault"), watch.rank, on_stall=watch.enter)
    try:  # the grid too: a failure after the rendezvous must still destroy the process group
        faults.start_up()
        if not under_torchrun():
            grid = ParallelGrid.single()
        else:
            world = range(int(os.environ.get("WORLD_SIZE", 1)))
            watch.enter("start-up: joining the process group", [r for r in world if r != watch.rank], startup=True)
            if p.plan == "auto":
                cfg = agreed_layout(cfg, watch)
                p = cfg.parallel
            # The rendezvous waits for peers still importing: bounded by the start-up timeout, not the step's.
            grid = ParallelGrid.build(p.dp, p.tp, process_pp(cfg), backend=p.backend,
                                      timeout_s=max(p.timeout_s, p.startup_timeout_s))
        watch_grid(watch, grid)
        watch.collective("start-up: agreeing on the run directory", "world", startup=True)
        run_dir = agree_on_run_dir(run_dir, grid)
        watch.run_dir = Path(run_dir)
        watch.enter("start-up: building model, engine and data")
        configure_worker_logging(Path(run_dir), grid.rank)
        quiet_progress_bars(grid.rank)
        trainer = Trainer(cfg, grid, Path(run_dir), StepGuard(cfg, grid, watch, faults))
        watch_engine(trainer.engine, watch, faults.before_action)
        losses = trainer.fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return losses


def agreed_layout(cfg: DictConfig, watch: Watch) -> DictConfig:
    """parallel.plan=auto under torchrun: rank 0's choice, applied and checked on every rank."""
    from training.planner.auto import agree_on_layout

    cfg = agree_on_layout(cfg, watch.rank)
    validate(cfg, int(os.environ["WORLD_SIZE"]))
    return cfg


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
    """Start world_size local workers through the torchrun launcher API and wait for all of them.

    A failure is reported once: the first failing rank's line, and with a timeout the merged hang summary."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
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
    for stale in (FAILURE_DIR, DUMP_DIR):  # a resumed run's directory may hold an earlier run's reports
        shutil.rmtree(Path(run_dir) / stale, ignore_errors=True)
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):  # we report failures ourselves, once
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[SELF_LAUNCHED] = "1"  # inherited by the workers
    # A worker that ends itself (os._exit) leaves its semaphores to the resource tracker, which would warn.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning:multiprocessing.resource_tracker")
    try:
        elastic_launch(config, entrypoint=worker_main)(OmegaConf.to_container(cfg, resolve=True), str(run_dir))
    except (KeyboardInterrupt, SignalException):
        print("sluice: interrupted; every worker was stopped", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except ChildFailedError as error:
        report_failed_launch(error, Path(run_dir), world_size)
        sys.exit(1)
    finally:
        os.environ.pop(SELF_LAUNCHED, None)


def report_failed_launch(error, run_dir: Path, world_size: int) -> None:
    """Print the first failing rank's line once; after a timeout, the hang summary from every rank's dump."""
    message = first_failure(run_dir)
    if message is None:  # the rank died without a word (killed, out of memory): what the launcher saw
        rank, failure = error.get_first_failure()
        message = f"rank {rank} died with exit code {failure.exitcode}"
    # A worker stopped by its watchdog may leave rank 0's progress bar unfinished on the line: start it over.
    restart = "\r\033[K" if sys.stderr.isatty() else "\r"
    print(f"{restart}sluice: {message} (the other workers were stopped)", file=sys.stderr)
    dumps = read_dumps(run_dir)
    if any(d["reason"] == "timeout" for d in dumps):
        print(f"sluice: hang summary ({run_dir / DUMP_DIR}):", file=sys.stderr)
        for line in summarize(dumps, world_size):
            print(f"  {line}", file=sys.stderr)
