"""Measuring a run's costs on its own device and dtype, at its micro-batch shape (micro_batch_size x seq_len).

One decoder layer, the embedding and the head with its loss are timed as the stage runs them (autocast, the
project's I/W split, its recompute pass), their saved bytes counted with saved-tensor hooks; the transport is
timed with two real processes (`probe.py`). Medians of a few repeats, at the thread count a rank will have."""

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

from models import build_model, decoder_of
from parallel.decoder import Decoder
from parallel.expert import expert_modules
from parallel.pipeline.weight_grad import SplitLinears, WeightGradStore
from parallel.recompute import apply_recompute
from parallel.step import autocast
from training.config.schema import model_config
from training.config.layout import layout_world_size, omp_threads
from training.objectives.lm import shifted_loss_sum
from training.layout_search.costs import (RECOMPUTE_MODES, Fit, MeasuredCosts, cost_key, fixed_parts,
                                    load_cached, save, timed_fields)
from training.layout_search.probe import measure_transport
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
    """The one layer of a one-layer model as a piece (its layer inputs, e.g. rotary tables, fixed for the shape)."""

    def __init__(self, decoder: Decoder, seq_len: int):
        ((self.layer_id, self.layer),) = decoder.blocks()
        self.adapter = decoder.adapter
        shape_of = torch.zeros(1, seq_len, decoder.config.hidden_size, device=next(decoder.module.parameters()).device)
        positions = torch.arange(seq_len, device=shape_of.device)[None]
        self.inputs = self.adapter.layer_inputs(decoder.module.get_submodule(decoder.plan.base), shape_of, positions)
        self.params = list(self.layer.parameters())
        self.fixed = _tensors(self.inputs)  # one set per stage, not per layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter.run_layer(self.layer_id, self.layer, x, self.inputs)[0]


class _Head:
    """The final pieces, the head and the summed next-token loss against fixed labels."""

    def __init__(self, decoder: Decoder, labels: torch.Tensor):
        self.finals = [decoder.module.get_submodule(name) for name in decoder.plan.finals]
        self.head, self.labels = decoder.module.get_submodule(decoder.plan.head), labels
        self.params = [p for m in self.finals for p in m.parameters()] + list(self.head.parameters())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for final in self.finals:
            x = final(x)
        return shifted_loss_sum(self.head(x), self.labels)


class _Embed:
    """The token embedding as the family runs it (input: token ids)."""

    def __init__(self, decoder: Decoder):
        self.base = decoder.module.get_submodule(decoder.plan.base)
        self.embed, self.adapter = decoder.module.get_submodule(decoder.plan.embedding), decoder.adapter
        self.params = list(self.embed.parameters())

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.adapter.embed(self.base, self.embed, ids)


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor inside a nest of dicts, tuples and lists."""
    if torch.is_tensor(value):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [t for item in items for t in _tensors(item)]


def one_layer_model(cfg: DictConfig, device: torch.device) -> Decoder:
    """The run's model cut to one decoder layer, initialised on `device` (fp32 master weights, as trained)."""
    config = model_config(cfg)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    decoder = decoder_of(build_model(config, device))
    decoder.module.train()
    return decoder


def measure_compute(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> dict:
    """Times, saved bytes and parameter counts of the embedding, one layer (per recompute mode) and the head."""
    decoder = one_layer_model(cfg, device)
    config = decoder.config
    mbs, seq, h = cfg.train.micro_batch_size, cfg.train.seq_len, config.hidden_size
    ids = torch.randint(0, config.vocab_size, (mbs, seq), device=device)
    x = torch.randn(mbs, seq, h, device=device, requires_grad=True)
    layer, head, embed = _Layer(decoder, seq), _Head(decoder, ids), _Embed(decoder)
    pieces = {"layer_" + mode: (layer if mode == "none" else
                                _Layer(apply_recompute(copy.deepcopy(decoder), mode), seq), x)
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
    final_params = sum(_count(m.parameters()) for m in head.finals)
    experts = [p for _, module in expert_modules(decoder) for p in module.parameters()]
    out.update(layer_params=_count(layer.params), embed_params=_count(embed.params),
               layer_expert_params=_count(experts),
               head_params=final_params + (0 if decoder.plan.ties else _count(head.head.parameters())),
               param_bytes=head.head.weight.element_size(),
               boundary_bytes=mbs * seq * h * 4,  # the residual stream stays fp32 under autocast
               optimizer_s_per_param=times["adamw", "step"] / _count(layer.params))
    return out


def layer_saved_bytes(cfg: DictConfig, mode: str, dtype: torch.dtype) -> int:
    """Bytes one layer of the run's model saves for backward per micro-batch, counted with saved-tensor hooks on the
    CPU at tp=1 (for families without a closed formula)."""
    device = torch.device("cpu")
    decoder = one_layer_model(cfg, device)
    layer = _Layer(apply_recompute(decoder, mode), cfg.train.seq_len)
    x = torch.randn(cfg.train.micro_batch_size, cfg.train.seq_len, decoder.config.hidden_size, requires_grad=True)
    return saved_bytes(layer, x, device, dtype)[0]


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
    return MeasuredCosts(key=key, p2p=Fit.of(transport["p2p"]), allreduce=Fit.of(transport["allreduce"]), **compute)


def run_setting(cfg: DictConfig, world_size: int | None = None) -> tuple[torch.device, torch.dtype, str, int]:
    """Device, compute dtype, backend and per-process threads of a run of `cfg` on `world_size` local processes."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    backend = cfg.parallel.backend if cfg.parallel.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    world = world_size or layout_world_size(cfg)
    threads = int(os.environ.get("OMP_NUM_THREADS") or omp_threads(world))
    return device, resolve_dtype(cfg.train.dtype, device), backend, threads


def measured_costs(cfg: DictConfig, world_size: int | None = None, refresh: bool = False,
                   cached_only: bool = False) -> MeasuredCosts | None:
    """The costs of `cfg`'s shape on this machine: from the cache, else measured now and cached (cached_only: None)."""
    device, dtype, backend, threads = run_setting(cfg, world_size)
    key = cost_key(cfg, device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
                   str(dtype).removeprefix("torch."), backend, threads)
    costs = None if refresh else load_cached(cfg, key)
    if costs is None and not cached_only:
        costs = measure(cfg, key, device, dtype, backend, threads)
        save(cfg, costs)
    return costs
