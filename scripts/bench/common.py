"""What every benchmark builds on: worker processes, the loop's step, activation and resident memory (timing and
results: `harness`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from parallel.fsdp import local  # noqa: E402
from training.optim import clip_grad_norm, lr_at, set_lr  # noqa: E402


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
        self.grad_bytes = grad_bytes(params)

    def __call__(self) -> float:
        return super().__call__(self.micro)

    def memory(self, among: set[int] | None = None) -> dict:
        """This rank's bytes of parameters, gradients (as the last backward left them) and optimizer state; of the
        parameters whose id is in `among` only, if given."""
        return held_bytes([p for p in self.params if among is None or id(p) in among], self.grad_bytes,
                          self.trainer.optimizer)


def grad_bytes(params: list) -> dict[int, int]:
    """This rank's bytes of each parameter's gradient now (a sharded one's local part), by id(param): a
    `LoopStep.on_grads` hook's record of the gradients the backward left."""
    return {id(p): _nbytes(p.grad) for p in params if p.grad is not None}


def held_bytes(params: list, grads: dict[int, int], optimizer) -> dict:
    """This rank's bytes of `params`, of their gradients as `grads` (`grad_bytes`) recorded them and of their state
    in `optimizer` (ZeRO-1's: this rank's part); DTensors (FSDP's shards) by their local part."""
    state = getattr(optimizer, "optim", optimizer).state  # ZeroRedundancyOptimizer keeps this rank's in .optim
    params = list({id(p): p for p in params}.values())
    weights = sum(_nbytes(p) for p in params)
    grads = sum(grads.get(id(p), 0) for p in params)
    states = sum(_nbytes(v) for p in params for v in state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return {"params": weights, "grads": grads, "optimizer": states, "total": weights + grads + states}


def _nbytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


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
