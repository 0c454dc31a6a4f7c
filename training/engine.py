"""The step interface the trainer calls, and its single-process implementation."""

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from training.data import MicroBatch
from training.loss import shifted_loss_sum


@dataclass
class StepResult:
    """What one optimizer step's forward/backward produced, identical on every rank."""

    loss: float  # token-weighted mean LM loss over the global batch
    aux_loss: float  # MoE load-balancing loss, mean over the global batch's micro-batches
    tokens: int  # label tokens in the global batch


class Engine(Protocol):
    """Runs forward and backward of one step; leaves summed, synchronised gradients on the parameters."""

    def step(self, micro_batches: list[MicroBatch]) -> StepResult: ...

    def named_parameters(self) -> dict[str, nn.Parameter]: ...

    def parameters(self) -> list[nn.Parameter]: ...

    def norm_parameters(self) -> list[nn.Parameter]: ...


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on the compute device, or nothing for fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class LocalEngine:
    """One process, one whole model: gradient accumulation over the step's micro-batches."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.device = device
        self.dtype = dtype

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def norm_parameters(self) -> list[nn.Parameter]:
        return self.parameters()

    def step(self, micro_batches: list[MicroBatch]) -> StepResult:
        tokens = sum(mb.num_label_tokens() for mb in micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float64)
        aux_sum = torch.zeros((), dtype=torch.float64)
        for mb in micro_batches:
            with autocast(self.device, self.dtype):
                out = self.model(input_ids=mb.input_ids.to(self.device))
            ce = shifted_loss_sum(out.logits, mb.labels.to(self.device))
            aux = out["aux_loss"]
            (ce / max(tokens, 1) + aux / len(micro_batches)).backward()
            loss_sum += ce.detach().double().cpu()
            aux_sum += aux.detach().double().cpu()
        return StepResult(float(loss_sum) / max(tokens, 1), float(aux_sum) / len(micro_batches), tokens)
