"""Stage: forward and backward of one model chunk for one micro-batch, keeping only what backward needs."""

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from parallel.decoder import Decoder
from parallel.step import Objective, TokenLoss, autocast

from .weight_grad import SplitLinears, WeightGradStore


@dataclass
class Saved:
    """What the backward of one micro-batch needs: the received input leaf and where to start autograd."""

    inputs: torch.Tensor | None  # the leaf whose .grad is sent upstream (None on the first stage)
    # Gradient edges, not the output tensors: the boundary activation's storage is free once it is sent,
    # since autograd needs only the node that produced it (Megatron frees it by hand for the same reason).
    edges: list[GradientEdge]
    seeds: list[torch.Tensor | None]  # the gradient fed to each edge; None = the one from the next stage


class Stage:
    """One pipeline stage (chunk) of the model on this rank: F, B, I and W for one micro-batch at a time."""

    def __init__(self, chunk: Decoder, index: int, n_stages: int, device: torch.device, dtype: torch.dtype,
                 token_loss: TokenLoss, split_backward: bool = False, objective: Objective | None = None):
        self.chunk = chunk
        self.module: nn.Module = chunk.module
        self.index = index
        self.is_first = index == 0
        self.is_last = index == n_stages - 1
        self.device = device
        self.dtype = dtype
        self.token_loss = token_loss
        self.objective = objective  # what the last stage computes from the logits (every stage: its sums' width)
        # Only schedules with I/W pay for the function mode that routes linears through the split backward.
        self.weight_grads = WeightGradStore() if split_backward else None
        self.saved: dict[int, Saved] = {}
        self.peak_live = 0  # most micro-batches holding saved state at once during the step
        # Each micro-batch's detached objective sums (the loss sum first) and aux sum, summed once when the step
        # reads them: a forward then adds no op of its own on the critical path, and nothing syncs with the host.
        self.loss_parts: list[torch.Tensor] = []
        self.aux_parts: list[torch.Tensor] = []

    def reset(self) -> None:
        """Forget the previous step's sums and peak; nothing may still be saved."""
        pending = self.weight_grads.pending if self.weight_grads is not None else {}
        if self.saved or pending:
            raise RuntimeError(f"stage {self.index}: micro-batches {sorted(self.saved)} never ran backward and "
                               f"{sorted(pending)} never ran W in the last step (a broken schedule)")
        self.loss_parts.clear()
        self.aux_parts.clear()
        self.peak_live = 0

    @property
    def loss_sums(self) -> torch.Tensor:
        """The step's objective sums so far, [objective.width] (float64, on the device; zeros off the last stage)."""
        return _sum64(self.loss_parts, self.device, self.objective.width)

    @property
    def aux_sum(self) -> torch.Tensor:
        """The step's aux-loss sum so far (float64, on the device)."""
        return _sum64(self.aux_parts, self.device)

    def live(self) -> int:
        """Micro-batches whose activations (or, after I, W's inputs) this stage holds now."""
        return len(self.saved) + (len(self.weight_grads.pending) if self.weight_grads is not None else 0)

    def forward(self, microbatch: int, inputs: torch.Tensor, labels: torch.Tensor | None,
                loss_scale: torch.Tensor | float, aux_scale: float,
                extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Run this chunk on one micro-batch; return the boundary activation (None on the last stage).

        The last stage's objective reads the labels and the micro-batch's `extra`, untouched.
        With gradients off (evaluation) nothing is saved and only the objective's sums are kept."""
        leaf = None
        split = SplitLinears(self.weight_grads) if self.weight_grads is not None else nullcontext()
        with autocast(self.device, self.dtype), split:
            if self.is_first:
                hidden, aux = self.chunk(input_ids=inputs)
            else:
                # Cross-process autograd: the received activation is a leaf whose grad goes upstream.
                leaf = inputs.detach().requires_grad_(True)
                hidden, aux = self.chunk(hidden=leaf)
            if self.is_last:  # the last chunk ends in the head: `hidden` holds the logits
                loss_sum, sums = self.objective(hidden, labels, extra or {}, self.token_loss)
        if not torch.is_grad_enabled():
            if self.is_last:
                self.loss_parts.append(sums)
            return None if self.is_last else hidden
        self.aux_parts.append(aux.detach())
        # Backward starts at the scalars themselves, seeded with their scale: the gradient a multiply by the
        # scale would have passed down, bit for bit, without the multiply.
        scalars, seeds = ([aux], [_seed(aux_scale, aux)]) if aux.requires_grad else ([], [])
        if self.is_last:
            self.loss_parts.append(sums)
            self._save(microbatch, leaf, [loss_sum, *scalars], [_seed(loss_scale, loss_sum), *seeds])
            return None
        self._save(microbatch, leaf, [hidden, *scalars], [None, *seeds])
        return hidden.detach()

    def _save(self, microbatch: int, leaf: torch.Tensor | None, outputs: list[torch.Tensor],
              seeds: list[torch.Tensor | None]) -> None:
        # A first stage that trains nothing (every trained weight on later stages) has no graph to start from.
        kept = [(o, s) for o, s in zip(outputs, seeds) if o.requires_grad]
        self.saved[microbatch] = Saved(leaf, [get_gradient_edge(o) for o, _ in kept], [s for _, s in kept])
        self.peak_live = max(self.peak_live, self.live())

    def backward(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """B: the full backward of one micro-batch (loss and aux included); return the input gradient."""
        return self._backward(microbatch, grad_output)

    def backward_input(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """I: the backward without the linear layers' weight gradients, which wait for W; return the input grad."""
        if self.weight_grads is None:
            raise RuntimeError(f"stage {self.index} was not built for split backward (I/W)")
        with self.weight_grads.defer(microbatch):
            return self._backward(microbatch, grad_output)

    def backward_weight(self, microbatch: int) -> None:
        """W: the weight gradients I deferred for this micro-batch."""
        self.weight_grads.apply(microbatch)

    def _backward(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        saved = self.saved.pop(microbatch)
        seeds = [grad_output if s is None else s for s in saved.seeds]
        if saved.edges:
            torch.autograd.backward(saved.edges, seeds)
        return None if saved.inputs is None else saved.inputs.grad


def _seed(scale: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """`scale` in `like`'s dtype and shape: what d(x * scale)/dx rounds to in x's dtype."""
    if isinstance(scale, torch.Tensor):
        return scale.to(like.dtype).expand_as(like)
    return torch.full_like(like, scale)


def _sum64(parts: list[torch.Tensor], device: torch.device, width: int | None = None) -> torch.Tensor:
    """Sum in float64, in order (the same rounding as adding each part as it came); [width], or a scalar."""
    total = torch.zeros(() if width is None else (width,), dtype=torch.float64, device=device)
    for part in parts:
        total += part.double()
    return total
