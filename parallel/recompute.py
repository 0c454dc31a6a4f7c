"""Activation recomputation, a pass over a built (pruned, TP-sharded) stage module, and its memory model.

`full` recomputes each decoder layer's forward in its backward, keeping only the layer's input. `selective`
(Megatron style) recomputes only cheap, memory-heavy parts: the attention core (the q/k norms and the SDPA
kernel; RoPE between them saves nothing) and the SwiGLU activation silu(gate); every linear layer's input stays
saved, so no linear layer runs twice. The pass patches instance `forward`s from outside, so the model file stays
single-device code and every parameter keeps its dense name (`model.layers.3.mlp.up_proj.weight`).

Under the I/W split the recomputation runs inside I under the forward's `SplitLinears`, so the recomputed
linears still defer their weight gradients to W (whose held inputs recomputation does not shrink).
"""

import types
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint
from torch.utils._device import DeviceContext

from minimind.model import Attention, FeedForward

MODES = ("none", "full", "selective")


def apply_recompute(module: nn.Module, mode: str) -> nn.Module:
    """Make the decoder layers of `module` (its `model.layers`) recompute activations in backward, in place."""
    if mode not in MODES:
        raise ValueError(f"train.recompute={mode!r} is not a recompute mode: use one of {'|'.join(MODES)}")
    if mode == "none":
        return module
    for layer in module.model.layers.values():
        if mode == "full":
            _patch_forward(layer, _Checkpointed(layer.forward))
            continue
        for sub in layer.modules():
            if type(sub) is Attention:
                _patch_forward(sub.q_norm, _Checkpointed(sub.q_norm.forward))
                _patch_forward(sub.k_norm, _Checkpointed(sub.k_norm.forward))
                _patch_forward(sub, _UnderMode(sub.forward, _CheckpointSDPA))
            elif type(sub) is FeedForward:
                _patch_forward(sub, types.MethodType(_feedforward_recomputing_activation, sub))
    return module


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


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _feedforward_recomputing_activation(ff: FeedForward, x: torch.Tensor) -> torch.Tensor:
    """FeedForward.forward with silu(gate) recomputed in backward; gate, up and down_proj's input stay saved."""
    return ff.down_proj(_checkpoint(_swiglu, ff.gate_proj(x), ff.up_proj(x)))


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


def saved_activation_bytes_per_layer(config, micro_batch_size: int, seq_len: int, dtype_bytes: int, mode: str,
                                     tp: int = 1) -> int:
    """Bytes one decoder layer of `config` (a MiniMindConfig) saves for backward per micro-batch on a TP rank."""
    # As saved-tensor hooks count them (each storage once, parameters and their casts not at all), for causal
    # attention without a mask (a fused SDPA kernel: output plus fp32 log-sum-exp), dropout 0 and no sequence
    # parallelism. Norms and the residual stream are fp32; under autocast (`dtype_bytes` < 4) each linear
    # saves its own cast of its input. Exact for dense layers; MoE totals are exact too, since every token is
    # routed to exactly top-k experts (the tests check both against the hooks).
    if mode not in MODES:
        raise ValueError(f"train.recompute={mode!r} is not a recompute mode: use one of {'|'.join(MODES)}")
    tokens, f, a, h = micro_batch_size * seq_len, 4, dtype_bytes, config.hidden_size
    if mode == "full":
        return tokens * f * h  # the layer's input
    heads, kv_heads = config.num_attention_heads // tp, max(config.num_key_value_heads // tp, 1)
    q, kv = heads * config.head_dim, kv_heads * config.head_dim
    casts = 1 if a < f else 0  # a cast linear input is one more copy per extra consumer
    selective = mode == "selective"
    per_token = 2 * f * (2 * h + 1)  # input and post-attention norms: input, rsqrt, normalised
    per_token += a * h * (1 + 2 * casts)  # q/k/v input
    # q/k norms: fp32 input, rsqrt, normalised (selective: only their input, recomputed in backward).
    per_token += a * (q + kv) if selective else f * (q + heads + kv + kv_heads) + a * (q + kv)
    per_token += a * (2 * q + 2 * kv) + (0 if selective else f * heads)  # SDPA: q, k, v, output (o_proj's input)
    if not config.use_moe:
        # MLP input, then gate, up, silu(gate) and down's input (selective recomputes silu(gate)).
        return tokens * (per_token + a * h * (1 + casts) + a * config.intermediate_size // tp * (3 if selective else 4))
    return tokens * per_token + _moe_bytes(config, tokens, a, tp, selective)


def _moe_bytes(config, tokens: int, a: int, tp: int, selective: bool) -> int:
    """The routed MLP's saved bytes: the router's per token, each of the top-k experts' per routed token."""
    f, h, k = 4, config.hidden_size, config.num_experts_per_tok
    casts = 1 if a < f else 0
    router = a * h + f * config.num_experts + 8 * k + f * (k + 1)  # input, scores, choice, weights
    # Per routed token: row and slot indices, the gathered input as gate and up see it, the SwiGLU, the
    # expert's output and its routing weight, the weighted output.
    expert = 16 + a * h * (1 + casts) + a * config.moe_intermediate_size // tp * (3 if selective else 4)
    expert += a * h + f + f * h
    return tokens * (router + k * expert) + f * config.num_experts  # + the aux loss's expert load


def deferred_weight_grad_bytes_per_layer(config, micro_batch_size: int, seq_len: int, dtype_bytes: int,
                                         tp: int = 1) -> int:
    """Bytes one decoder layer holds per micro-batch between I and W (the same under every recompute mode)."""
    # Each linear's input (one cast per linear under autocast) and output gradient, in the compute dtype.
    tokens, a, h = micro_batch_size * seq_len, dtype_bytes, config.hidden_size
    casts = 1 if a < 4 else 0
    heads, kv_heads = config.num_attention_heads // tp, max(config.num_key_value_heads // tp, 1)
    q, kv = heads * config.head_dim, kv_heads * config.head_dim
    attention = h * (1 + 2 * casts) + q + (q + 2 * kv + h)  # inputs of q/k/v and o, then their output grads
    if not config.use_moe:
        ffn = config.intermediate_size // tp  # inputs of gate/up and down, then their output grads
        return tokens * a * (attention + h * (1 + casts) + ffn + (2 * ffn + h))
    ffn, k = config.moe_intermediate_size // tp, config.num_experts_per_tok
    router = h + config.num_experts  # the router's input and output grad
    return tokens * a * (attention + router + k * (h * (1 + casts) + ffn + (2 * ffn + h)))
