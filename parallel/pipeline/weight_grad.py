"""Split backward for zero-bubble schedules: I computes input gradients, W later computes the linear weights'.

During a stage's forward, `SplitLinears` routes every `F.linear` on a Parameter (nn.Linear, the TP column/row
layers, the head) through `_SplitLinear`. Its backward always returns the input gradient; under B it also
returns the weight gradient as autograd would, under I it queues `(input, grad_output)` for the micro-batch
instead. W pops the queue and adds `grad_output^T @ input` to `.grad`: no part of I's work is redone.
Small parameters (norms, embedding, q/k norms) keep taking their gradient in I. The model never knows.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


@dataclass
class Deferred:
    """One linear's weight-gradient work for one micro-batch: what W multiplies, and where it adds."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    inputs: torch.Tensor  # the linear's input as the matmul saw it (compute dtype)
    grad_output: torch.Tensor


class WeightGradStore:
    """A stage's queue of deferred weight-gradient work, keyed by micro-batch."""

    def __init__(self) -> None:
        self.pending: dict[int, list[Deferred]] = {}
        self.deferring: int | None = None  # the micro-batch whose I is running, read inside backward

    @contextmanager
    def defer(self, microbatch: int) -> Iterator[None]:
        """Within: split linears queue their weight gradients under `microbatch` instead of computing them."""
        self.pending.setdefault(microbatch, [])  # an I with no linear still needs its W
        self.deferring = microbatch
        try:
            yield
        finally:
            self.deferring = None

    @torch.no_grad()  # as autograd's own accumulation: no graph behind a gradient (emulation's inputs require grad)
    def apply(self, microbatch: int) -> None:
        """W: compute and accumulate every weight gradient queued for `microbatch`, then free its tensors."""
        for work in self.pending.pop(microbatch):
            grad_weight, grad_bias = weight_grads(work.inputs, work.grad_output, work.bias is not None)
            _accumulate(work.weight, grad_weight)
            if work.bias is not None:
                _accumulate(work.bias, grad_bias)


def weight_grads(inputs: torch.Tensor, grad_output: torch.Tensor,
                 with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d(x W^T + b)/dW and /db for input [..., in] and output gradient [..., out]."""
    flat_out = grad_output.reshape(-1, grad_output.shape[-1])
    grad_weight = flat_out.t().mm(inputs.reshape(-1, inputs.shape[-1]))
    return grad_weight, flat_out.sum(0) if with_bias else None


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """param.grad += grad, as autograd's AccumulateGrad would (the first gradient is taken as is)."""
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _SplitLinear(torch.autograd.Function):
    """F.linear whose weight gradient is computed now (B) or queued on the store (I)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None,
                store: WeightGradStore) -> torch.Tensor:
        # Cast as autocast would, explicitly: backward runs outside autocast and must use the same dtype.
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x_c, w_c = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x_c, w_c)
        ctx.store, ctx.weight, ctx.bias, ctx.x_dtype = store, weight, bias, x.dtype
        return F.linear(x_c, w_c, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x_c, w_c = ctx.saved_tensors
        grad_x = grad_output.matmul(w_c).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            return grad_x, None, None, None
        store = ctx.store
        if store.deferring is not None:
            store.pending[store.deferring].append(Deferred(ctx.weight, ctx.bias, x_c, grad_output))
            return grad_x, None, None, None
        grad_weight, grad_bias = weight_grads(x_c, grad_output, ctx.bias is not None)
        return (grad_x, grad_weight.to(ctx.weight.dtype),
                None if grad_bias is None else grad_bias.to(ctx.bias.dtype), None)


class SplitLinears(TorchFunctionMode):
    """Within a stage's forward: every F.linear on a trainable Parameter becomes a `_SplitLinear` on `store`.

    A function mode rather than module surgery: it catches nn.Linear and the TP layers alike, keeps every
    module and parameter name, and leaves the model file untouched.
    """

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every op of the forward passes through here: the common case (not a linear) goes straight on.
        if func is not F.linear:
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        # A parameter with its own gradient hooks must see its gradient inside backward: not deferred.
        if isinstance(weight, nn.Parameter) and weight.requires_grad and not weight._backward_hooks:
            return _SplitLinear.apply(x, weight, bias, self.store)
        return func(*args, **kwargs)
