"""What every benchmark shares: worker processes, step timing, activation-memory tracking, results.json."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import pickle
import platform
import queue
import socket
import statistics
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from training.optim import clip_grad_norm, lr_at, set_lr  # noqa: E402

RESULTS = ROOT / "bench" / "results.json"


def stamped(micro_batches: list) -> list:
    """The micro-batches as Sluice's data layer hands them to a step: each carries the global label-token count
    (torch's side gets the same count, computed once outside its timed steps)."""
    tokens = sum(mb.num_label_tokens() for mb in micro_batches)
    return [replace(mb, global_tokens=tokens) for mb in micro_batches]


# --- Worker processes ----------------------------------------------------------------------------------
# The project's test helper lives under tests/; scripts sit above every layer and may not import tests, so
# this is the same few lines: N spawned gloo processes, results by rank, every worker killed on timeout.


def _worker(fn: Callable, rank: int, world: int, port: int, results: mp.Queue, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # N workers share two cores; intra-op threads would only fight over them
    try:
        results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable, world: int, *args: Any, timeout: float = 900) -> list:
    """Run `fn(rank, world, *args)` in `world` spawned processes; return the results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, results, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__}: ranks {sorted(set(range(world)) - set(done))} timed out")
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise RuntimeError(f"{fn.__name__}: ranks {dead} died without reporting")
                continue
            if not ok:
                raise RuntimeError(f"{fn.__name__}: rank {rank} failed:\n{payload}")
            done[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [done[r] for r in range(world)]


def init_gloo() -> None:
    """Join the process group the spawned environment describes (gloo: this is a CPU benchmark)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")


# --- One training step ----------------------------------------------------------------------------------


class LoopStep:
    """What the Trainer's loop does per optimizer step (learning rate, engine step, grad-norm clipping, AdamW),
    without data loading and logging; `on_grads(params)` sees the gradients before they are clipped and freed."""

    def __init__(self, engine, optimizer, grid, optim_cfg, total_steps: int, grad_clip: float,
                 on_grads: Callable[[list], None] | None = None):
        self.engine, self.optimizer, self.grid, self.cfg = engine, optimizer, grid, optim_cfg
        self.total_steps, self.grad_clip, self.on_grads, self.step_no = total_steps, grad_clip, on_grads, 0
        self.params, self.norm_params = engine.parameters(), engine.norm_parameters()

    def __call__(self, micro: list) -> float:
        set_lr(self.optimizer, lr_at(self.step_no, self.total_steps, self.cfg))
        result = self.engine.step(micro)
        if self.on_grads is not None:
            self.on_grads(self.params)
        clip_grad_norm(self.params, self.norm_params, self.grad_clip, self.grid.mp_group, self.grid.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_no += 1
        return result.loss


class TrainerStep(LoopStep):
    """One optimizer step of the Trainer's loop on its first batch every time (the variants see the same data),
    keeping the gradients' bytes for `memory`."""

    def __init__(self, trainer):  # training.trainer.Trainer
        cfg = trainer.cfg
        super().__init__(trainer.engine, trainer.optimizer, trainer.grid, cfg.optim, cfg.train.steps,
                         cfg.train.grad_clip, on_grads=self._count_grads)
        self.trainer, self.micro = trainer, next(iter(trainer.data))
        self.grad_bytes: dict[int, int] = {}

    def _count_grads(self, params: list) -> None:
        self.grad_bytes = {id(p): _nbytes(p.grad) for p in params if p.grad is not None}

    def __call__(self) -> float:
        return super().__call__(self.micro)

    def memory(self, among: set[int] | None = None) -> dict:
        """This rank's bytes of parameters, gradients (as the last backward left them) and optimizer state; of the
        parameters whose id is in `among` only, if given."""
        held = [p for p in self.params if among is None or id(p) in among]
        optimizer = self.trainer.optimizer.state
        params = sum(_nbytes(p) for p in held)
        grads = sum(self.grad_bytes.get(id(p), 0) for p in held)
        state = sum(_nbytes(v) for p in held for v in optimizer.get(p, {}).values() if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- Timing --------------------------------------------------------------------------------------------


def timed(step: Callable[[], Any]) -> tuple[float, float, Any]:
    """One step on every rank from a common start: the slowest rank's wall time, the CPU time of all ranks
    together (what the step costs whatever else the machine runs), and the step's result."""
    if dist.is_initialized():
        dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    out = step()
    spent = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
            spent = spent.to(torch.device("cuda", torch.cuda.current_device()))
        wall, cpu_sum = spent.clone(), spent.clone()
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu_sum)
        spent = torch.stack([wall[0], cpu_sum[1]])
    return float(spent[0]), float(spent[1]), out


@dataclass
class Times:
    """One variant's measured steps: wall time (slowest rank) and CPU time (all ranks), in seconds."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def summary(self, prefix: str) -> dict:
        """`{prefix}_s` (median wall), `{prefix}_min_s`, `{prefix}_cpu_s` (median CPU) and the raw runs."""
        return {f"{prefix}_s": statistics.median(self.wall), f"{prefix}_min_s": min(self.wall),
                f"{prefix}_cpu_s": statistics.median(self.cpu), f"{prefix}_runs_s": self.wall}


def paired(row: dict) -> dict:
    """Each round ran one Sluice step and one torch step back to back: the median of their differences and how
    many rounds Sluice won. Two medians taken apart can differ by chance more than this; it shows a tie as one."""
    diffs = [a - b for a, b in zip(row["sluice_runs_s"], row["torch_runs_s"])]
    return {"paired_diff_ms": 1000 * statistics.median(diffs), "sluice_wins": sum(d < 0 for d in diffs),
            "rounds": len(diffs)}


def alternate(variants: dict[str, Callable[[], Any]], warmup: int, rounds: int) -> dict[str, Times]:
    """Warm every variant up, then run one step of each per round, the order reversed every other round (A B, B A,
    ...: a step's slot in the round biases it, e.g. the second slot measured 1.06-1.13x the first with two equal
    eager variants at pp2, and a fixed order would charge that to one side); step times by variant."""
    for _ in range(warmup):
        for step in variants.values():
            timed(step)
    times = {name: Times() for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            step = variants[name]
            wall, cpu, _ = timed(step)
            times[name].wall.append(wall)
            times[name].cpu.append(cpu)
    return times


def first_then_alternate(steps: dict[str, Callable[[list], Any]], micro: list, warmup: int, rounds: int) -> dict:
    """Each variant's first loss on `micro` (the same weights and data give the same loss), then their step times
    taken in turns (`alternate`)."""
    first = {name: step(micro) for name, step in steps.items()}
    times = alternate({name: (lambda step=step: step(micro)) for name, step in steps.items()}, warmup, rounds)
    return {"times": times, "first_loss": first}


def peak_growth_mib(build: Callable[[], Callable[[list], Any]], micro: list, steps: int = 3) -> float:
    """Build a variant and run `steps` steps of it: the peak resident set above what the process held before the
    build, in MiB (run it in a fresh process, under `freed_to_the_system`)."""
    before = resident_kib("VmRSS")
    step = build()
    for _ in range(steps):
        step(micro)
    return (resident_kib("VmHWM") - before) / 1024


# --- Activation memory ---------------------------------------------------------------------------------


class ActivationMeter:
    """Peak bytes of activations alive at once: tensors autograd saves for backward plus each stage's boundary
    output while something still holds it. Storages are counted once however many tensors view them."""

    def __init__(self) -> None:
        self.refs: dict[int, list[int]] = {}  # storage address -> [bytes, holders]
        self.live = 0
        self.peak = 0

    def hold(self, t: torch.Tensor) -> None:
        """Count `t`'s storage until the returned holder (or `t` itself, see `watch`) goes away."""
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self.refs.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        return key

    def release(self, key: int) -> None:
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[key]

    def watch(self, t: torch.Tensor) -> None:
        """Count a boundary output for as long as the Python tensor object lives."""
        weakref.finalize(t, self.release, self.hold(t))

    @contextmanager
    def saved_tensors(self):
        """Within: every tensor autograd saves is counted until its graph lets it go."""

        def pack(t: torch.Tensor) -> _Held:
            return _Held(t, self)

        def unpack(held: _Held) -> torch.Tensor:
            return held.tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


class _Held:
    """A saved tensor and its place in the meter; dropping it (autograd freeing the graph) releases it."""

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter):
        self.tensor = tensor
        self.meter = meter
        self.key = meter.hold(tensor)

    def __del__(self) -> None:
        self.meter.release(self.key)


def boundary(chunk) -> nn.Module:
    """The module whose output leaves a pipeline chunk (a `parallel.decoder.Decoder`): the last layer, or on the
    last chunk the last piece before the head."""
    if chunk.has_head:
        return chunk.module.get_submodule(chunk.plan.finals[-1])
    return chunk.blocks()[-1][1]


def watch_outputs(modules: list[nn.Module], meter: ActivationMeter) -> list:
    """Forward hooks that count each module's first output (a MiniMind layer returns (hidden, aux))."""

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled():
            meter.watch(hidden)

    return [m.register_forward_hook(hook) for m in modules]


@contextmanager
def freed_to_the_system():
    """Within: spawned workers have glibc serve every allocation over 64 KiB by its own mmap and unmap it when freed
    (`MALLOC_MMAP_THRESHOLD_`, read at process start), so their resident set follows the live tensors. Without it,
    malloc's reuse of freed heap moved a variant's peak resident set by 10% from one fresh process to the next."""
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous


def resident_kib(field: str) -> int:
    """This process's VmHWM (peak resident set) or VmRSS (now) in KiB, from /proc (Linux); 0 elsewhere."""
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.exists() else ():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# --- Results -------------------------------------------------------------------------------------------


def bench_parser(doc: str, smoke_help: str, rounds: int, warmup: int | None = None) -> argparse.ArgumentParser:
    """The options of every benchmark script: --smoke, --rounds, --warmup (where it warms up) and --results."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--rounds", type=int, default=rounds)
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--results", type=Path, default=RESULTS)
    return parser



def machine() -> dict:
    """What the figures were measured on."""
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def update_results(section: str, value: Any, path: Path = RESULTS) -> None:
    """Write one section of results.json, keeping the others."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data[section] = value
    data["machine"] = machine()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free interval of the median of `values`: order statistics k and n + 1 - k, k the largest with
    P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2 (at least 1), and the coverage that interval has."""
    ordered, n = sorted(values), len(values)

    def below(k: int) -> float:  # P(Binomial(n, 1/2) < k): the chance the median lies below order statistic k
        return sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and below(k + 1) <= (1 - confidence) / 2:
        k += 1
    return ordered[k - 1], ordered[n - k], 1 - 2 * below(k)


def ratio_and_spread(ours: list[float], theirs: list[float]) -> dict:
    """The median of the per-round ratios ours / theirs (each round ran one step of each back to back), their
    spread (half the interquartile range; 0 with one round) and the ratios themselves."""
    return median_and_spread([a / b for a, b in zip(ours, theirs)])


def median_and_spread(ratios: list[float]) -> dict:
    """Per-round ratios summed up: their median, their spread (half the interquartile range; 0 with one round) and
    the ratios themselves."""
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"ratio": statistics.median(ratios), "spread": (q3 - q1) / 2, "round_ratios": ratios}
