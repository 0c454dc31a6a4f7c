"""Transport timings with two real processes: boundary-tensor P2P and all-reduce, with the run's backend.

Only torch is imported here: each spawned process pays for its imports, and this module is all they load."""

import multiprocessing as mp
import os
import queue
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

REPEATS = 5


def _timed(fn, repeats: int = REPEATS) -> float:
    """Median seconds of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ping_pong(rank: int, tensor: torch.Tensor) -> None:
    """Rank 0 sends and gets the tensor back; one call is two transfers."""
    peer = 1 - rank
    if rank == 0:
        dist.send(tensor, peer)
        dist.recv(tensor, peer)
    else:
        dist.recv(tensor, peer)
        dist.send(tensor, peer)


def _measure(rank: int, sizes: list[int], device: str) -> dict[str, list[tuple[int, float]]]:
    """(bytes, seconds) of one P2P transfer and of one all-reduce for each size (floats of 4 bytes)."""
    p2p, reduce = [], []
    for nbytes in sizes:
        tensor = torch.ones(max(nbytes // 4, 1), device=device)
        p2p.append((nbytes, _timed(lambda: _ping_pong(rank, tensor)) / 2))
        reduce.append((nbytes, _timed(lambda: (dist.all_reduce(tensor), dist.barrier()))))
    return {"p2p": p2p, "allreduce": reduce}


def _worker(rank: int, port: int, backend: str, threads: int, sizes: list[int], results) -> None:
    """One of the two processes: join, measure, report rank 0's figures."""
    torch.set_num_threads(threads)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        figures = _measure(rank, sizes, device)
        if rank == 0:
            results.put(figures)
    finally:
        dist.destroy_process_group()


def measure_transport(backend: str, threads: int, sizes: list[int], timeout_s: float = 120.0) -> dict:
    """Spawn two processes, time P2P and all-reduce of `sizes` bytes; kill both after `timeout_s`."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    procs = [ctx.Process(target=_worker, args=(r, store.port, backend, threads, sizes, results), daemon=True)
             for r in range(2)]
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited at spawn, as the launcher's workers get it
    try:
        for p in procs:
            p.start()
        return _result(results, procs, timeout_s)
    finally:
        _restore("OMP_NUM_THREADS", env)
        for p in procs:
            if p.pid is None:
                continue  # never started
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


def _result(results, procs: list, timeout_s: float) -> dict:
    """Rank 0's figures; an error as soon as a probe process dies, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a transport probe process exited with code {dead[0]}") from None
    raise TimeoutError(f"the transport probe did not finish within {timeout_s:.0f} s")


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
