"""Run a function in N processes wired for torch.distributed (env://), with a hard timeout.

Spawning N interpreters that import torch costs seconds per test on two cores, most of the suite's time; so by
default the processes of one world size are kept for the session and run each test's function in turn on their
one process group (`WorkerPool`). A job that fails or times out discards its pool (its ranks may be stuck in a
collective); a test that needs brand-new processes (peak memory, a rank that exits) passes `fresh=True`.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

STARTED, DONE, FAILED = "started", "done", "failed"  # what a worker reports, in this order


def rendezvous_store(timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on a port the OS picks, held by this process: workers join it as clients
    (torchrun's agent-store mode), so no port is released and re-bound in between."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def _next_job(jobs: mp.Queue, parent: int) -> Any:
    """The next job, or None once the pool is closed or the session that owns it is gone (killed pytest: no orphan
    keeps polling the CPU of later runs)."""
    while True:
        try:
            return jobs.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _pool_worker(rank: int, world_size: int, port: int, jobs: mp.Queue, results: mp.Queue, parent: int) -> None:
    """Child body: set the torchrun-style env, then run each job `(id, fn, args, kwargs)` until None arrives."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      TORCHELASTIC_USE_AGENT_STORE="True")  # every rank is a client of the parent's store
    torch.set_num_threads(1)  # N workers share few cores; intra-op threads would only oversubscribe them
    gc.freeze()  # torch's import-time objects, as train.py does
    results.put((None, rank, STARTED, None))  # spawned and imported
    try:
        while (job := _next_job(jobs, parent)) is not None:
            job_id, fn, args, kwargs = job
            try:
                # Plain pickle copies tensors by value; the queue's own pickler would hand over shared-memory
                # handles that die with this process.
                results.put((job_id, rank, DONE, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
            except BaseException:
                results.put((job_id, rank, FAILED, traceback.format_exc()))
            finally:
                _release_subgroups()
                # What is left lives on for the next jobs (imported modules, caches): moved out of the collector's
                # sight, so the next job's collections (the one above, and the automatic full ones while it trains)
                # walk only what that job made, not torch's and transformers' import-time objects (0.25 s a
                # collection). The collection just before leaves no garbage cycle to freeze.
                gc.collect()
                gc.freeze()
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _release_subgroups() -> None:
    """Destroy every process group a job created, the default group aside. A pooled process runs many jobs, each
    building a grid (DeviceMesh and its own groups); a gloo group keeps three threads for as long as it exists, one
    of them polling its sockets. Kept, they added up to hundreds of threads per worker by the end of a load run,
    about 10% of a core each worker. torch lists the groups only in `distributed_c10d._world` (no public API)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed import distributed_c10d as c10d

    gc.collect()  # a job's engine (and the groups its grid holds) may sit in a reference cycle until collected

    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _stop(procs: list) -> None:
    """Terminate, then kill, every worker still alive."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


class WorkerPool:
    """`world_size` spawned processes on one rendezvous, running jobs one after another."""

    def __init__(self, world_size: int, start_timeout: float):
        ctx = mp.get_context("spawn")
        self.world_size, self.next_job = world_size, 0
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.store = rendezvous_store(7 * 24 * 3600)  # held as long as the pool lives
        self.procs = [ctx.Process(target=_pool_worker, daemon=True, args=(
            r, world_size, self.store.port, self.jobs[r], self.results, os.getpid())) for r in range(world_size)]
        for p in self.procs:
            p.start()
        self._collect(None, start_timeout, "run_workers: ranks {missing} did not start within {timeout:g}s")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        """fn(rank, world_size, *args, **kwargs) on every rank; results by rank, or the first error raised."""
        job, self.next_job = self.next_job, self.next_job + 1
        for jobs in self.jobs:
            jobs.put((job, fn, args, kwargs))
        done = self._collect(job, timeout, f"run_workers({fn.__name__}): ranks {{missing}} did not finish within "
                                           "{timeout:g}s", fn.__name__)
        return [pickle.loads(done[rank]) for rank in range(self.world_size)]

    def _collect(self, job: int | None, timeout: float, late: str, name: str = "") -> dict[int, Any]:
        """Every rank's report of `job` (None: the start-up) within `timeout` seconds."""
        done: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(late.format(missing=sorted(set(range(self.world_size)) - set(done)),
                                               timeout=timeout))
            try:
                # Bounded wait so that a worker that dies without reporting is noticed below.
                job_id, rank, kind, payload = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                crashed = [(r, p.exitcode) for r, p in enumerate(self.procs) if r not in done and not p.is_alive()]
                if crashed and self.results.empty():
                    raise RuntimeError(f"run_workers({name}): ranks exited without reporting (rank, exitcode): "
                                       f"{crashed}") from None
                continue
            if job_id != job:
                continue  # a report of an earlier job of this pool (cannot happen after a failure: pools are dropped)
            if kind == FAILED:
                raise RuntimeError(f"run_workers({name}): rank {rank} failed:\n{payload}")
            done[rank] = payload
        return done

    def close(self) -> None:
        """Ask every worker to leave, then make sure none is left."""
        for jobs in self.jobs:
            try:
                jobs.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        _stop(self.procs)
        for q in (self.results, *self.jobs):
            q.close()
            q.cancel_join_thread()
        del self.store  # the server closes once the workers are gone


_POOLS: dict[int, WorkerPool] = {}  # world size -> this test session's pool (closed at exit)


def close_pools() -> None:
    """Stop every pooled worker (at the end of the session, or to start over)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_pools)


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 120, start_timeout: float = 600,
                fresh: bool = False, **kwargs: Any) -> list:
    """Run fn(rank, world_size, *args, **kwargs) on world_size processes; return results by rank.

    fn must be a module-level function. The first worker error is re-raised here with its traceback. `timeout`
    counts from the moment every worker is ready (spawning and importing on a busy machine is bounded separately
    by `start_timeout`); after it every worker is killed and the unfinished ranks are named. The processes are the
    session's pool of this world size unless `fresh`; any failure discards the pool it ran on."""
    pool = None if fresh else _POOLS.pop(world_size, None)
    if pool is not None and not pool.alive():
        pool.close()
        pool = None
    try:
        pool = pool or WorkerPool(world_size, start_timeout)
        results = pool.run(fn, args, kwargs, timeout)
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    if fresh:
        pool.close()
    else:
        _POOLS[world_size] = pool
    return results
