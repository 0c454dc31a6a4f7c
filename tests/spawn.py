"""Run a function in N fresh processes wired for torch.distributed (env://), with a hard timeout."""

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, results: mp.Queue,
            args: tuple, kwargs: dict) -> None:
    """Child body: set the torchrun-style env, run fn, report (rank, ok, payload), free the process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # N workers share few cores; intra-op threads would only oversubscribe them
    try:
        # Plain pickle copies tensors by value; the queue's own pickler would hand over shared-memory
        # handles that die with this process.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
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


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 120, **kwargs: Any) -> list:
    """Run fn(rank, world_size, *args, **kwargs) in world_size spawned processes; return results by rank.

    fn must be a module-level function. The first worker error is re-raised here with its traceback;
    after `timeout` seconds every worker is killed and the unfinished ranks are named.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, rank, world_size, port, results, args, kwargs), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise TimeoutError(f"run_workers({fn.__name__}): ranks {missing} did not finish within {timeout:g}s")
            try:
                # Bounded wait so that a worker that dies without reporting is noticed below.
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                crashed = [(r, p.exitcode) for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
                if crashed and results.empty():
                    raise RuntimeError(f"run_workers({fn.__name__}): ranks exited without reporting "
                                       f"(rank, exitcode): {crashed}")
                continue
            if not ok:
                raise RuntimeError(f"run_workers({fn.__name__}): rank {rank} failed:\n{payload}")
            done[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        _stop(procs)
        results.close()
    return [done[rank] for rank in range(world_size)]
