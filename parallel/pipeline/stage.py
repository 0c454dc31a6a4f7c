"""Stage: forward and backward of one model chunk for one micro-batch, keeping only what backward needs."""

from dataclasses import dataclass

import torch
from torch import nn

from training.engine import autocast
from training.loss import TokenLoss, shifted_loss_sum


@dataclass
class Saved:
    """What the backward of one micro-batch needs: the received input leaf and the outputs to differentiate."""

    inputs: torch.Tensor | None  # the leaf whose .grad is sent upstream (None on the first stage)
    outputs: list[torch.Tensor]
    grads_from_outside: bool  # True when outputs[0] waits for a gradient from the next stage


class Stage:
    """One pipeline stage (chunk) of the model on this rank: F and B for one micro-batch at a time."""

    def __init__(self, module: nn.Module, index: int, n_stages: int, device: torch.device, dtype: torch.dtype,
                 token_loss: TokenLoss):
        self.module = module
        self.index = index
        self.is_first = index == 0
        self.is_last = index == n_stages - 1
        self.device = device
        self.dtype = dtype
        self.token_loss = token_loss
        self.saved: dict[int, Saved] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.aux_sum = torch.zeros((), dtype=torch.float64)

    def reset(self) -> None:
        """Forget the previous step's sums; nothing may still be saved."""
        assert not self.saved, f"stage {self.index}: micro-batches {sorted(self.saved)} never ran backward"
        self.loss_sum.zero_()
        self.aux_sum.zero_()

    def forward(self, microbatch: int, inputs: torch.Tensor, labels: torch.Tensor | None,
                loss_scale: float, aux_scale: float) -> torch.Tensor | None:
        """Run this chunk on one micro-batch; return the boundary activation (None on the last stage)."""
        leaf = None
        with autocast(self.device, self.dtype):
            if self.is_first:
                hidden, aux = self.module.model(input_ids=inputs)
            else:
                # Cross-process autograd: the received activation is a leaf whose grad goes upstream.
                leaf = inputs.detach().requires_grad_(True)
                hidden, aux = self.module.model(inputs_embeds=leaf)
            if self.is_last:
                loss_sum = shifted_loss_sum(self.module.lm_head(hidden), labels, self.token_loss)
        self.aux_sum += aux.detach().double().cpu()
        outputs = [aux * aux_scale] if aux.requires_grad else []
        if self.is_last:
            self.loss_sum += loss_sum.detach().double().cpu()
            self.saved[microbatch] = Saved(leaf, [loss_sum * loss_scale] + outputs, grads_from_outside=False)
            return None
        self.saved[microbatch] = Saved(leaf, [hidden] + outputs, grads_from_outside=True)
        return hidden.detach()

    def backward(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of one micro-batch (loss and aux terms included); return the input gradient to send."""
        saved = self.saved.pop(microbatch)
        outputs = saved.outputs
        grads = [grad_output] if saved.grads_from_outside else [None]
        grads += [None] * (len(outputs) - 1)
        torch.autograd.backward(outputs, [g if g is not None else torch.ones_like(o) for g, o in zip(grads, outputs)])
        return None if saved.inputs is None else saved.inputs.grad

