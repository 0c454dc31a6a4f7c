"""From a composed config to running workers: in-process, under torchrun, or self-launched locally."""

import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from checkpoint.manager import ownership_problem
from parallel.grid import local_device_problem, ParallelGrid, resolve_backend
from parallel.collectives import broadcast_object
from training.reliability.hang import DUMP_DIR, Watch, read_dumps, summarize, watch_engine, watch_grid
from training.reliability.heartbeat import Beater
from training.launch.cluster import is_launch_leader, node_launch
from training.config import CONF_DIR, ConfigError
from training.config.validate import validate
from training.report.console import run_dir_problem, quiet_progress_bars
from training.reliability.failures import FAILURE_DIR, describe_failure, first_failure, is_known, record_failure
from training.reliability import flight_recorder
from training.reliability.faults import FaultInjector
from training.config.resume_rules import batch_change_problem
from training.config.layout import layout_world_size, omp_threads, process_pp, resolved_dp
from training.launch.rendezvous import AttemptStore, attempt_store
from training.report.run_log import ConfinedFileHandler, confine_log_files
from training.launch.restarts import RestartBudget, newest_step, restart_resume
from training.specs import checkpoint_spec
from training.reliability.watchdog import EXIT_INTERRUPTED, Interrupted, Limits, exit_code, report_hang, start_watchdog
from training.reliability.guard import StepGuard

log = logging.getLogger("sluice")
SELF_LAUNCHED = "SLUICE_SELF_LAUNCHED"  # set for the workers of self_launch: their root reports failures
WORKER_ENTRY = Path(__file__).resolve().parent / "worker_entry.py"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    """Hydra task: one run (or one job of a sweep)."""
    confine_log_files()  # Hydra opened train.log with a plain FileHandler: never write through a link there
    run(cfg, Path(HydraConfig.get().runtime.output_dir))


def under_torchrun() -> bool:
    """True when a launcher (torchrun, the elastic agent, srun+torchrun) already started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run(cfg: DictConfig, run_dir: Path) -> None:
    """Validate, then train here (one process or torchrun rank) or start the local workers."""
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else layout_world_size(cfg)
    try:
        if cfg.parallel.layout == "auto" and not under_torchrun():  # under torchrun the ranks agree in run_worker
            from training.layout_search.auto import choose_layout  # the cost model: layout=auto only

            cfg = choose_layout(cfg, world_size)
        validate(cfg, world_size)
        if problem := local_device_problem(cfg.parallel.backend, local_workers(world_size)):
            raise ConfigError(problem)  # CUDA would say 'invalid device ordinal' in the workers past the last GPU
        if is_launch_leader(os.environ):  # the run directory and the checkpoints, before any worker starts
            first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # a restart continues its own run
            checkpoints = checkpoint_spec(cfg, run_dir)
            problem = ((first_start and run_dir_problem(run_dir, cfg.checkpoint.resume, checkpoints.dir))
                       or ownership_problem(checkpoints)  # another run's checkpoint.dir
                       or batch_change_problem(cfg, checkpoints.dir, resolved_dp(cfg, world_size)))
            if problem:  # batch_change_problem: a resume at another global batch would shift its steps and data
                raise ConfigError(problem)
    except ConfigError as error:
        print(f"sluice: config error: {error}", file=sys.stderr)
        sys.exit(2)
    if under_torchrun() or world_size == 1:
        worker_main(OmegaConf.to_container(cfg, resolve=True), str(run_dir))
    else:
        self_launch(cfg, world_size, run_dir)


def local_workers(world_size: int) -> int:
    """The workers this host runs: torchrun's LOCAL_WORLD_SIZE, else this node's share of the self-launch."""
    if under_torchrun():
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    try:
        return node_launch(world_size, os.environ).nproc_per_node
    except ValueError as error:  # the layout does not split over the job's nodes
        raise ConfigError(str(error)) from None


def worker_main(cfg_dict: dict, run_dir: str) -> list[float]:
    """A rank as a process: watchdog (timeouts, signals, launcher death) and failures as one line."""
    rank, launched = int(os.environ.get("RANK", 0)), under_torchrun()
    announce = os.environ.get(SELF_LAUNCHED) != "1"  # a self-launch root prints the first failure itself
    p = cfg_dict["parallel"]
    limits = Limits(float(p["timeout_s"]), float(p["startup_timeout_s"]))
    watch = Watch(rank, groups={"world": list(range(int(os.environ.get("WORLD_SIZE", 1))))})
    # A torchrun rank >= 1 ran Hydra in the working directory: it learns the run directory from rank 0 at start-up,
    # and until then writes no report anywhere (never into the working directory).
    watch.run_dir = None if launched and announce and rank else Path(run_dir)
    if launched:
        name_process(f"sluice-rank{rank}")
        watch.beater = Beater(dict(os.environ), rank, len(watch.groups["world"]))
    watchdog = start_watchdog(watch, limits, announce, follow_launcher=launched)  # one process: for its signals
    try:
        return run_worker(cfg_dict, run_dir, watch)
    except Interrupted as stop:  # the loop saved (or said why not) and rank 0 printed the line
        sys.exit(stop.code)
    except KeyboardInterrupt:
        print("sluice: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as error:
        if limits.exceeded(watch, 0.9):
            report_hang(watch, limits, announce)  # a wait that timed out (not a dead peer): the hang report
        else:
            where = watch.run_dir
            message = describe_failure(error, where, rank)
            dead = watch.beater.blame(rank, dead_only=True) if watch.beater and not is_known(error) else None
            if dead is None:
                record_failure(where, rank, message, announce)
            else:  # a peer's death surfaces here as a connection error: the dead peer is the cause
                culprit, line = dead
                record_failure(where, rank, f"{line} (rank {rank} saw: {message.removeprefix(f'rank {rank}: ')})",
                               announce, culprit.rank, culprit.kind)
        if launched:
            leave_at_once(1)
        sys.exit(1)
    finally:
        watchdog.stop()


def leave_at_once(code: int) -> NoReturn:
    """End the process now, reported and flushed, without tearing anything down. A failed worker: a process group
    may still run a collective with a stalled peer on its own thread, and freeing the group (when the handler drops
    the traceback's frames, or at interpreter exit) joins that thread, which waits for the peer forever. An
    interrupted self-launch root: torch's launcher leaves the rendezvous open on a signal, so its keep-alive daemon
    thread still writes to the store every 5 s, and one caught in that C++ call when Python finalizes aborts the
    process (SIGABRT instead of exit 130)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def name_process(name: str) -> None:
    """Show this worker as `name` in ps, top and /proc/<pid>/comm (Linux; elsewhere a no-op): which pid is rank 2
    is then one `pgrep sluice-rank2` away, for a debugger, py-spy or a deliberate kill."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def run_worker(cfg_dict: dict, run_dir: str, watch: Watch | None = None) -> list[float]:
    """Body of every rank: grid, trainer, loop, clean shutdown. Returns the per-step losses."""
    from training.trainer import Trainer  # models, DCP: in a worker only

    cfg = OmegaConf.create(cfg_dict)
    p = cfg.parallel
    watch = watch if watch is not None else Watch(int(os.environ.get("RANK", 0)))
    faults = FaultInjector(OmegaConf.select(cfg, "debug.fault"), watch.rank, on_stall=watch.enter)
    start = None
    try:  # the grid too: a failure after the rendezvous must still destroy the process group
        if under_torchrun():
            peers = [r for r in range(int(os.environ["WORLD_SIZE"])) if r != watch.rank]
            watch.enter("start-up: joining the process group", peers, startup=True)
            # The rendezvous waits for peers still importing: bounded by the start-up timeout, not the step's.
            start = attempt_store(os.environ, run_dir, max(p.timeout_s, p.startup_timeout_s))
            if start is not None:  # rank 0's run directory, before anything else can fail on this rank
                run_dir = start.run_dir
                watch.run_dir = Path(run_dir)
        faults.start_up()
        if not under_torchrun():
            grid = ParallelGrid.single()
        else:
            watch.enter("start-up: joining the process group", peers, startup=True)
            if p.layout == "auto":
                cfg = agreed_layout(cfg, watch, start)
                p = cfg.parallel
            if watch.run_dir is not None:  # before the process group: NCCL reads it as it starts
                flight_recorder.enable(watch.run_dir, resolve_backend(p.backend)[0])
            grid = ParallelGrid.build(p.dp, p.tp, process_pp(cfg), backend=p.backend,
                                      timeout_s=max(p.timeout_s, p.startup_timeout_s), ep=p.ep,
                                      store=start.store if start else None)
        watch_grid(watch, grid)
        watch.collective("start-up: agreeing on the run directory", "world", startup=True)
        # Under torchrun each rank ran Hydra; rank 0's output directory is the run's one directory.
        run_dir = broadcast_object(run_dir, None if grid.world_size == 1 else dist.group.WORLD, src=0)
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


def agreed_layout(cfg: DictConfig, watch: Watch, start: AttemptStore | None) -> DictConfig:
    """parallel.layout=auto under torchrun: rank 0's choice, applied and checked on every rank."""
    from training.layout_search.auto import agree_on_layout  # the cost model: layout=auto only

    cfg = agree_on_layout(cfg, watch.rank, start.store if start else None)
    validate(cfg, int(os.environ["WORLD_SIZE"]))
    return cfg


def configure_worker_logging(run_dir: Path, rank: int) -> None:
    """Self-launched workers start without Hydra's logging: rank 0 logs as Hydra would, to the console and train.log."""
    root = logging.getLogger()
    if root.handlers or rank != 0:
        return  # Hydra configured this process already, or this rank stays quiet
    form = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    for handler in (logging.StreamHandler(sys.stdout), ConfinedFileHandler(run_dir / "train.log")):
        handler.setFormatter(form)
        root.addHandler(handler)
    root.setLevel(logging.INFO)


def self_launch(cfg: DictConfig, world_size: int, run_dir: Path) -> None:
    """Start world_size local workers through the torchrun launcher API and wait for all of them; with
    train.max_restarts, start them again after a failure, from the newest complete checkpoint. A failure is reported
    once: the culprit's line, and with a timeout the merged hang summary."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    node = node_launch(world_size, os.environ)  # this node's share under a multi-node submitit job
    budget = RestartBudget(int(cfg.train.max_restarts))
    if budget.limit and node.nnodes > 1:
        print("sluice: config error: train.max_restarts restarts a single-node self-launch; on several nodes use "
              "torchrun --max-restarts with checkpoint.resume=auto (docs/launching.md)", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("OMP_NUM_THREADS", str(omp_threads(node.nproc_per_node)))  # workers inherit it
    log.info("launching %d local workers (dp*tp*pp) into %s", world_size, run_dir)
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):  # we report failures ourselves, once
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[SELF_LAUNCHED] = "1"  # inherited by the workers
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    checkpoints = checkpoint_spec(cfg, run_dir).dir
    try:
        for attempt in itertools.count():
            try:
                launch_workers(node, attempt, cfg_dict, Path(run_dir))
                return
            except ChildFailedError as error:
                # Interrupted: the workers saved and rank 0 said so; a rank still leaving when the launcher stopped
                # the group after the first one's exit shows as killed by the launcher's SIGTERM.
                interrupted = {exit_code(signal.SIGINT), exit_code(signal.SIGTERM)}
                codes = {f.exitcode for f in error.failures.values()}
                if codes & interrupted and codes <= interrupted | {-signal.SIGTERM, -signal.SIGINT}:
                    leave_at_once(max(codes))
                cause = launch_failure(error, Path(run_dir))
                step = newest_step(checkpoints)
                if not budget.allow(step):
                    report_failed_launch(cause, Path(run_dir), world_size, budget, step)
                    sys.exit(1)
                where = f"checkpoint step {step}" if step else "the start (no checkpoint yet)"
                note = f"{cause}; restart {budget.used(step)} of {budget.limit} from {where}"
                say_over_bar(note)
                log.warning("restart: %s", note)
                cfg_dict["checkpoint"]["resume"] = restart_resume(cfg_dict["checkpoint"]["resume"], checkpoints)
    except (KeyboardInterrupt, SignalException) as error:  # the agent passed the signal on: workers save first
        print("sluice: interrupted; every worker was stopped", file=sys.stderr)
        leave_at_once(exit_code(error.sigval) if isinstance(error, SignalException) else EXIT_INTERRUPTED)
    finally:
        os.environ.pop(SELF_LAUNCHED, None)


def launch_workers(node, attempt: int, cfg_dict: dict, run_dir: Path) -> None:
    """One start of this node's workers (a fresh rendezvous per attempt); raises ChildFailedError on a failure."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for stale in (FAILURE_DIR, DUMP_DIR):  # a resumed run's directory may hold an earlier attempt's reports
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    # The agent's error files and the workers' config: ours to remove, not left in the system's temp folder.
    scratch = Path(tempfile.mkdtemp(prefix="sluice-launch-"))
    (scratch / "config.json").write_text(json.dumps(cfg_dict))
    config = LaunchConfig(min_nodes=node.nnodes, max_nodes=node.nnodes, nproc_per_node=node.nproc_per_node,
                          run_id=f"{node.run_id}-{attempt}", rdzv_backend="c10d", rdzv_endpoint=node.rdzv_endpoint,
                          max_restarts=0, monitor_interval=0.1,
                          logs_specs=DefaultLogsSpecs(log_dir=str(scratch / "agent")))
    try:
        elastic_launch(config, entrypoint=sys.executable)(str(WORKER_ENTRY), str(scratch / "config.json"), str(run_dir))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def launch_failure(error, run_dir: Path) -> str:
    """One line for a failed group: the culprit's own words, the heartbeats' verdict or the launcher's."""
    killed = {rank: f.signal_name() for rank, f in error.failures.items() if f.exitcode < 0}
    message = first_failure(run_dir, killed)
    if message is None:  # the rank died without a word (killed, out of memory): what the launcher saw
        rank, failure = error.get_first_failure()
        message = f"rank {rank} died with exit code {failure.exitcode}"
    return message


def say_over_bar(message: str) -> None:
    """Print a `sluice:` line on stderr; a worker stopped mid-step may leave rank 0's progress bar unfinished on
    the line, so the line is started over."""
    restart = "\r\033[K" if sys.stderr.isatty() else "\r"
    print(f"{restart}sluice: {message}", file=sys.stderr, flush=True)


def report_failed_launch(cause: str, run_dir: Path, world_size: int, budget: RestartBudget, step: int) -> None:
    """Print the cause once; after a timeout, the hang summary from every rank's dump."""
    gave_up = (f"; it failed {budget.used(step)} times after checkpoint step {step}, more than "
               f"train.max_restarts={budget.limit}") if budget.limit else ""
    say_over_bar(f"{cause} (the other workers were stopped{gave_up})")
    dumps = read_dumps(run_dir)
    if any(d["reason"] == "timeout" for d in dumps):
        print(f"sluice: hang summary ({run_dir / DUMP_DIR}):", file=sys.stderr)
        for line in summarize(dumps, world_size):
            print(f"  {line}", file=sys.stderr)
