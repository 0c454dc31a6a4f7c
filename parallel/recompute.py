"""Activation recomputation: a pass over a built (pruned, TP-sharded) decoder chunk.

`full` recomputes each decoder layer's forward in its backward, keeping only the layer's input. `selective`
(Megatron style) recomputes only cheap, memory-heavy parts, which the family's adapter names per layer: an
attention core (its norms and the SDPA kernel; RoPE between them saves nothing) and a gated activation
act(gate) * up (from two projections, or from one packing [gate | up]); every linear layer's input stays saved, so
no linear layer runs twice. The pass patches instance `forward`s from outside, so the model file stays single-device
code and every parameter keeps its dense name.

Under the I/W split the recomputation runs inside I under the forward's `SplitLinears`, so the recomputed
linears still defer their weight gradients to W (whose held inputs recomputation does not shrink).
"""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint
from torch.utils._device import DeviceContext

from parallel.decoder import Decoder


MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class SdpaCore:
    """Recompute an attention module's SDPA kernel and `norms` (its per-head q/k norms) in backward."""

    module: nn.Module
    norms: tuple[nn.Module, ...] = ()


@dataclass(frozen=True)
class GatedActivation:
    """Recompute act(gate(x)) * up(x) of a gated MLP in backward; gate, up and down's input stay saved."""

    module: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module
    act: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PackedGatedActivation:
    """Recompute act(gate) * up of a gated MLP whose one projection packs [gate | up] (Phi-3's `gate_up_proj`; under
    TP its local output is [this rank's gate | its up], halves alike); gate_up and down's input stay saved."""

    module: nn.Module
    gate_up: nn.Module
    down: nn.Module
    act: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class UnknownRole:
    """A part of a layer whose role (`attention core`, `MLP activation`) the family's adapter cannot name:
    `selective` leaves it saved, and the run says so at start (`unknown_roles`) rather than change silently."""

    module: nn.Module
    role: str


def unknown_roles(decoder: Decoder) -> list[str]:
    """One line per kind of layer part that `train.recompute=selective` cannot recompute, for the start of a run."""
    found: dict[tuple[str, str], list[int]] = {}
    for layer_id, layer in decoder.blocks():
        for target in decoder.adapter.selective_recompute(layer):
            if isinstance(target, UnknownRole):
                found.setdefault((type(target.module).__name__, target.role), []).append(layer_id)
    family = getattr(decoder.config, "model_type", "?")
    return [f"train.recompute=selective: {family}'s {kind} has no {role} its adapter names (in {len(ids)} layers): "
            "it is kept saved, not recomputed; name its role in the family adapter's selective_recompute"
            for (kind, role), ids in found.items()]


def apply_recompute(decoder: Decoder, mode: str) -> Decoder:
    """Make the layers of `decoder` (a `parallel.decoder.Decoder`) recompute activations in backward, in place."""
    if mode not in MODES:
        raise ValueError(f"train.recompute={mode!r} is not a recompute mode: use one of {'|'.join(MODES)}")
    if mode == "none":
        return decoder
    for _, layer in decoder.blocks():
        if mode == "full":
            _patch_forward(layer, _Checkpointed(layer.forward))
            continue
        for target in decoder.adapter.selective_recompute(layer):
            if isinstance(target, SdpaCore):
                for norm in target.norms:
                    _patch_forward(norm, _Checkpointed(norm.forward))
                _patch_forward(target.module, _UnderMode(target.module.forward, _CheckpointSDPA))
            elif isinstance(target, PackedGatedActivation):
                _patch_forward(target.module, _PackedGatedRecomputed(target))
            elif isinstance(target, GatedActivation):
                _patch_forward(target.module, _GatedRecomputed(target))
    return decoder


def _patch_forward(module: nn.Module, forward: Callable) -> None:
    """Shadow the class's forward with `forward` on this instance only; names and state_dict are untouched."""
    if "forward" in vars(module):
        raise RuntimeError(f"{type(module).__name__} already has a patched forward: apply_recompute runs once")
    module.forward = forward


def _checkpoint(function: Callable, *args, **kwargs):
    """Non-reentrant checkpoint (RNG state preserved, so dropout recomputes the same mask) whose recomputation
    runs under the function modes the forward ran under."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)  # nothing will be saved: eval and generation pay nothing
    if torch.compiler.is_compiling():  # train.compile: dynamo's checkpoint takes no context_fn of function modes,
        # and recomputes the graph it traced (a compiled ZB-V with selective recompute equals eager: tests/test_compile)
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    return checkpoint(function, *args, use_reentrant=False, context_fn=_same_function_modes, **kwargs)


class _Checkpointed:
    """A bound forward run under `_checkpoint` (a class, not a closure, so deepcopy rebinds it to the copy)."""

    def __init__(self, forward: Callable):
        self.forward = forward

    def __call__(self, *args, **kwargs):
        return _checkpoint(self.forward, *args, **kwargs)


class _UnderMode:
    """A bound forward run under a fresh instance of a TorchFunctionMode class."""

    def __init__(self, forward: Callable, mode: type[TorchFunctionMode]):
        self.forward, self.mode = forward, mode

    def __call__(self, *args, **kwargs):
        with self.mode():
            return self.forward(*args, **kwargs)


class _CheckpointSDPA(TorchFunctionMode):
    """Within an attention forward: the SDPA kernel is checkpointed (its output stays saved by o_proj)."""

    def __torch_function__(self, func, _types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            # Cast q, k, v as autocast would inside the kernel, so that the region saves them in that dtype.
            return _checkpoint(func, *(_autocast_input(a) for a in args), **kwargs)
        return func(*args, **kwargs)


def _autocast_input(x):
    """`x` in the autocast dtype where autocast is on and `x` is a floating tensor, else `x`."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(torch.get_autocast_dtype(x.device.type))


class _GatedRecomputed:
    """A gated MLP's forward with act(gate) * up recomputed in backward (a class, so deepcopy rebinds it)."""

    def __init__(self, target: GatedActivation):
        self.target = target

    def _activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.target.act(gate) * up

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = self.target
        return t.down(_checkpoint(self._activation, t.gate(x), t.up(x)))


class _PackedGatedRecomputed:
    """A packed gated MLP's forward with act(gate) * up recomputed in backward (a class, so deepcopy rebinds it)."""

    def __init__(self, target: PackedGatedActivation):
        self.target = target

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return up * self.target.act(gate)  # the order Phi-3 multiplies in (exact either way)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = self.target
        return t.down(_checkpoint(self._activation, t.gate_up(x)))


def _same_function_modes() -> tuple[AbstractContextManager, AbstractContextManager]:
    """checkpoint's context_fn, called at forward time: recompute under the function modes active now."""
    # torch.utils.checkpoint restores autocast, RNG and the device context but no other function mode, and the
    # recomputation runs inside backward (maybe on autograd's device thread), where the stage's `SplitLinears`
    # is not active: the recomputed linears would then save other tensors than the forward's `_SplitLinear`s,
    # which checkpoint refuses. torch has no public accessor for the mode stack; checkpoint itself reads it
    # with the same private helper.
    modes = [m for m in _get_current_function_mode_stack() if not isinstance(m, DeviceContext)]
    return nullcontext(), _Reentered(modes)


class _Reentered:
    """Enters `modes` (outermost first), skipping those already active on this thread."""
    # A class, not a generator: a retained graph may recompute the same region twice with this one context.

    def __init__(self, modes: Sequence[TorchFunctionMode]):
        self.modes = modes
        self.stacks: list[ExitStack] = []

    def __enter__(self) -> None:
        active = {id(m) for m in _get_current_function_mode_stack()}
        stack = ExitStack()
        for mode in self.modes:
            if id(mode) not in active:
                stack.enter_context(mode)
        self.stacks.append(stack)

    def __exit__(self, *exc) -> bool | None:
        return self.stacks.pop().__exit__(*exc)
