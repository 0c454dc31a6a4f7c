"""Run a function in N fresh processes wired for torch.distributed (env://), with a hard timeout."""

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

STARTED, DONE, FAILED = "started", "done", "failed"  # what a worker reports, in this order


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (for tools that must be given one; it may be taken
    again before they bind it: run_workers avoids the race with a store it owns)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rendezvous_store(timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on a port the OS picks, held by this process: workers join it as clients
    (torchrun's agent-store mode), so no port is released and re-bound in between."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def _worker(fn: Callable, rank: int, world_size: int, port: int, results: mp.Queue,
            args: tuple, kwargs: dict) -> None:
    """Child body: set the torchrun-style env, run fn, report (rank, ok, payload), free the process group."""
    results.put((rank, STARTED, None))  # spawned and imported: the run's timeout starts now
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      TORCHELASTIC_USE_AGENT_STORE="True")  # every rank is a client of the parent's store
    torch.set_num_threads(1)  # N workers share few cores; intra-op threads would only oversubscribe them
    try:
        # Plain pickle copies tensors by value; the queue's own pickler would hand over shared-memory
        # handles that die with this process.
        results.put((rank, DONE, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
    except BaseException:
        results.put((rank, FAILED, traceback.format_exc()))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


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


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 120, start_timeout: float = 600,
                **kwargs: Any) -> list:
    """Run fn(rank, world_size, *args, **kwargs) in world_size spawned processes; return results by rank.

    fn must be a module-level function. The first worker error is re-raised here with its traceback.
    `timeout` counts from the moment every worker has started (spawning and importing on a busy machine
    is bounded separately by `start_timeout`); after it every worker is killed and the unfinished ranks
    are named.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = rendezvous_store(start_timeout + timeout)
    procs = [ctx.Process(target=_worker, args=(fn, rank, world_size, store.port, results, args, kwargs),
                         daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    started: set[int] = set()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + start_timeout
    try:
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if len(started) < world_size:
                    missing = sorted(set(range(world_size)) - started)
                    raise TimeoutError(f"run_workers({fn.__name__}): ranks {missing} did not start within "
                                       f"{start_timeout:g}s")
                missing = sorted(set(range(world_size)) - set(done))
                raise TimeoutError(f"run_workers({fn.__name__}): ranks {missing} did not finish within {timeout:g}s")
            try:
                # Bounded wait so that a worker that dies without reporting is noticed below.
                rank, kind, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                crashed = [(r, p.exitcode) for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
                if crashed and results.empty():
                    raise RuntimeError(f"run_workers({fn.__name__}): ranks exited without reporting "
                                       f"(rank, exitcode): {crashed}")
                continue
            if kind == STARTED:
                started.add(rank)
                if len(started) == world_size:
                    deadline = time.monotonic() + timeout
            elif kind == FAILED:
                raise RuntimeError(f"run_workers({fn.__name__}): rank {rank} failed:\n{payload}")
            else:
                done[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        _stop(procs)
        results.close()
        del store  # the server closes once the workers are gone
    return [done[rank] for rank in range(world_size)]
