"""Measuring a run's costs on its own device and dtype, at its micro-batch shape (micro_batch_size x seq_len).

One decoder layer, the embedding and the head with its loss are timed as the stage runs them (autocast, the
project's I/W split, its recompute pass), their saved bytes counted with saved-tensor hooks; the transport is
timed with two real processes (`probe.py`). Medians of a few repeats, at the thread count a rank will have."""

from __future__ import annotations

import copy
import logging
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from omegaconf import DictConfig
from torch import nn

from minimind import MiniMindForCausalLM
from parallel.pipeline.weight_grad import SplitLinears, WeightGradStore
from parallel.recompute import apply_recompute
from parallel.step import autocast, shifted_loss_sum
from training.cluster import omp_threads
from training.schema import model_config
from training.layout import layout_world_size
from training.planner.costs import (RECOMPUTE_MODES, Fit, MeasuredCosts, cache_path, cost_key, fixed_parts,
                                    load_cached, save, timed_fields)
from training.planner.probe import measure_transport
from training.specs import resolve_dtype

log = logging.getLogger("sluice")
REPEATS = 5
Piece = Callable[[torch.Tensor], torch.Tensor]  # input -> output (the head: -> the loss)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternated(tasks: dict, device: torch.device, repeats: int = REPEATS) -> dict:
    """Median seconds of each task's timed part (a task is a set-up that returns it), one run of every task per
    round so that a change in the machine's load falls on all of them alike; the first round warms up."""
    times: dict = {name: [] for name in tasks}
    for k in range(repeats + 1):
        for name, setup in tasks.items():
            timed = setup()
            _sync(device)
            start = time.perf_counter()
            timed()
            _sync(device)
            if k:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def piece_tasks(piece: Piece, x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> dict[str, Callable]:
    """Set-ups timing forward, full backward and the I/W split of `piece` on input `x` (for `alternated`)."""
    def forward(mode=None):
        with autocast(device, dtype), (mode or nullcontext()):
            out = piece(x)
        return out, (torch.ones_like(out) if out.dim() else None)

    def f():
        return lambda: forward()

    def b():
        out, grad = forward()
        return lambda: out.backward(grad)

    store = WeightGradStore()

    def i():
        store.pending.clear()  # the previous repeat's deferred work: W is timed on its own
        out, grad = forward(SplitLinears(store))

        def run():
            with store.defer(0):
                out.backward(grad)
        return run

    def w():
        i()()
        return lambda: store.apply(0)

    return {"f": f, "b": b, "i": i, "w": w}


def saved_bytes(piece: Piece, x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes the forward saves for backward (each storage once; parameters, their casts and the piece's fixed
    tensors not), and bytes held between I and W."""
    held: dict[int, int] = {}
    weights = {s for p in piece.params for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    exclude = {t.untyped_storage().data_ptr() for t in [*piece.params, *getattr(piece, "fixed", ())]}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        cast_weight = t.dtype != torch.float32 and tuple(t.shape) in weights
        if key not in exclude and not cast_weight:
            held[key] = t.untyped_storage().nbytes()
        return t

    store = WeightGradStore()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype), SplitLinears(store):
        out = piece(x)
    with store.defer(0):
        out.backward(torch.ones_like(out) if out.dim() else None)
    deferred = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for work in store.pending.pop(0) for t in (work.inputs, work.grad_output)}
    return sum(held.values()), sum(deferred.values())


class _Layer:
    """Decoder layer 0 of a model as a piece (RoPE tables fixed for the shape)."""

    def __init__(self, model: MiniMindForCausalLM, seq_len: int):
        self.layer = model.model.layers["0"]
        positions = torch.arange(seq_len, device=model.model.rope_cos.device)[None]
        self.cos, self.sin = model.model.rope_cos[positions], model.model.rope_sin[positions]
        self.params = list(self.layer.parameters())
        self.fixed = (self.cos, self.sin)  # one pair per stage, not per layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, self.cos, self.sin)[0]


class _Head:
    """Final norm, lm_head and the summed next-token loss against fixed labels."""

    def __init__(self, model: MiniMindForCausalLM, labels: torch.Tensor):
        self.model, self.labels = model, labels
        self.params = list(model.model.norm.parameters()) + list(model.lm_head.parameters())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return shifted_loss_sum(self.model.lm_head(self.model.model.norm(x)), self.labels)


class _Embed:
    """The token embedding (input: token ids)."""

    def __init__(self, model: MiniMindForCausalLM):
        self.embed = model.model.embed_tokens
        self.params = list(self.embed.parameters())

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


def one_layer_model(cfg: DictConfig, device: torch.device) -> MiniMindForCausalLM:
    """The run's model cut to one decoder layer, initialised on `device` (fp32 master weights, as trained)."""
    config = model_config(cfg)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    with torch.device(device):
        model = MiniMindForCausalLM(config)
    model.model.reset_rope()
    return model.train()


def measure_compute(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> dict:
    """Times, saved bytes and parameter counts of the embedding, one layer (per recompute mode) and the head."""
    model = one_layer_model(cfg, device)
    mbs, seq, h = cfg.train.micro_batch_size, cfg.train.seq_len, model.config.hidden_size
    ids = torch.randint(0, model.config.vocab_size, (mbs, seq), device=device)
    x = torch.randn(mbs, seq, h, device=device, requires_grad=True)
    layer, head, embed = _Layer(model, seq), _Head(model, ids), _Embed(model)
    pieces = {"layer_" + mode: (layer if mode == "none" else
                                _Layer(apply_recompute(copy.deepcopy(model), mode), seq), x)
              for mode in RECOMPUTE_MODES}
    pieces.update(embed=(embed, ids), head=(head, x))
    tasks = {(name, kind): setup for name, (piece, inputs) in pieces.items()
             for kind, setup in piece_tasks(piece, inputs, device, dtype).items()}
    tasks["adamw", "step"] = _adamw_task(layer.params)
    times = alternated(tasks, device)
    out = {"layer_b": {}, "layer_i": {}, "layer_saved": {}}
    for mode in RECOMPUTE_MODES:
        name = "layer_" + mode
        out["layer_b"][mode], out["layer_i"][mode] = times[name, "b"], times[name, "i"]
        out["layer_saved"][mode], deferred = saved_bytes(*pieces[name], device, dtype)
    out.update(layer_f=times["layer_none", "f"], layer_w=times["layer_none", "w"], layer_deferred=deferred)
    for name in ("embed", "head"):
        out.update({f"{name}_{kind}": times[name, kind] for kind in "fbiw"})
        out[f"{name}_saved"], out[f"{name}_deferred"] = saved_bytes(*pieces[name], device, dtype)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    out.update(layer_params=_count(layer.params), embed_params=_count(embed.params),
               head_params=_count(model.model.norm.parameters()) + (0 if tied else _count(model.lm_head.parameters())),
               param_bytes=model.lm_head.weight.element_size(),
               boundary_bytes=mbs * seq * h * 4,  # the residual stream stays fp32 under autocast
               optimizer_s_per_param=times["adamw", "step"] / _count(layer.params))
    return out


def _count(params) -> int:
    return sum(p.numel() for p in params)


def _adamw_task(params: list[nn.Parameter]) -> Callable:
    """A set-up timing what the trainer does per parameter after the backward: the gradient norm with clipping,
    then one AdamW step (the run's optimizer), with gradients in place."""
    grads = [torch.randn_like(p) for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def run():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    def setup():
        for p, g in zip(params, grads):
            p.grad = g
        return run
    return setup


def transport_sizes(boundary_bytes: int) -> list[int]:
    """Message sizes to fit: the boundary tensor and its neighbours, and bucket-sized all-reduces."""
    return sorted({max(boundary_bytes // 4, 4), boundary_bytes, 4 * boundary_bytes, 1 << 22})


def measure(cfg: DictConfig, key: dict, device: torch.device, dtype: torch.dtype, backend: str,
            threads: int) -> MeasuredCosts:
    """Every figure of `MeasuredCosts`, at `threads` intra-op threads (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compute = measure_compute(cfg, device, dtype)
        doubled = copy.deepcopy(cfg)  # the same pieces at twice the micro-batch: what does not scale with it
        doubled.train.micro_batch_size = 2 * cfg.train.micro_batch_size
        compute["fixed"] = fixed_parts(timed_fields(compute), timed_fields(measure_compute(doubled, device, dtype)))
    finally:
        torch.set_num_threads(before)
    if backend == "nccl" and torch.cuda.device_count() < 2:  # NCCL needs one device per process
        log.warning("one CUDA device: transport not measured, communication predicted as free")
        return MeasuredCosts(key=key, **compute)
    transport = measure_transport(backend, threads, transport_sizes(compute["boundary_bytes"]))
    return MeasuredCosts(key=key, p2p=Fit.of(transport["p2p"]), allreduce=Fit.of(transport["allreduce"]),
                         **compute)


def run_setting(cfg: DictConfig, world_size: int | None = None) -> tuple[torch.device, torch.dtype, str, int]:
    """Device, compute dtype, backend and per-process threads of a run of `cfg` on `world_size` local processes."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    backend = cfg.parallel.backend if cfg.parallel.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    world = world_size or layout_world_size(cfg)
    threads = int(os.environ.get("OMP_NUM_THREADS") or omp_threads(world))
    return device, resolve_dtype(cfg.train.dtype, device), backend, threads


def measured_costs(cfg: DictConfig, world_size: int | None = None, refresh: bool = False,
                   cached_only: bool = False) -> MeasuredCosts | None:
    """The costs of `cfg`'s shape on this machine: from the cache, else measured now and cached.

    `cached_only`: None rather than measuring (callers that must stay fast)."""
    device, dtype, backend, threads = run_setting(cfg, world_size)
    key = cost_key(cfg, device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
                   str(dtype).removeprefix("torch."), backend, threads)
    costs = None if refresh else load_cached(cfg, key)
    if costs is None and not cached_only:
        costs = measure(cfg, key, device, dtype, backend, threads)
        save(cfg, costs)
    return costs
