"""The step contract between the trainer and any engine: micro-batches in, a StepResult out, gradients left
on the parameters. Also the token loss and autocast every engine shares, and the single-process engine."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from parallel.decoder import Decoder

IGNORE_INDEX = -100  # labels with this value do not enter the loss (torch cross-entropy default)
TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def target_counts(labels: torch.Tensor) -> torch.Tensor:
    """Per row of [B, S] labels: how many enter the shifted loss (position 0 is never a target)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)


@dataclass
class MicroBatch:
    """One micro-batch: token ids and (unshifted) labels of the same shape.

    `global_tokens` is the label-token count of the whole global step this micro-batch belongs to (every DP
    replica's micro-batches), when the data layer knows it; with it the engine needs no collective to scale
    the loss (like transformers' `num_items_in_batch`). Every micro-batch of a step carries the same value."""

    input_ids: torch.Tensor  # [B, S] long
    labels: torch.Tensor  # [B, S] long, -100 = ignored, NOT shifted (the model shifts)
    global_tokens: int | None = None

    def label_tokens(self) -> torch.Tensor:
        """Number of labels that enter the shifted loss (position 0 is never a target), as a tensor."""
        return target_counts(self.labels).sum()

    def num_label_tokens(self) -> int:
        """`label_tokens` as a Python int (a host sync: not for the per-micro-batch hot path)."""
        return int(self.label_tokens())


@dataclass
class StepResult:
    """What one optimizer step's forward/backward produced, identical on every rank."""

    loss: float  # token-weighted mean LM loss over the global batch
    aux_loss: float  # MoE load-balancing loss, mean over the global batch's micro-batches
    tokens: int  # label tokens in the global batch
    trace: Any = None  # with `trace=True`: every rank's timed actions on global rank 0, else None


class Engine(Protocol):
    """Runs forward and backward of one step; leaves summed, synchronised gradients on the parameters."""

    def step(self, micro_batches: list[MicroBatch], trace: bool = False) -> StepResult: ...

    def evaluate(self, micro_batches: list[MicroBatch]) -> StepResult: ...

    def named_parameters(self) -> dict[str, nn.Parameter]: ...

    def parameters(self) -> list[nn.Parameter]: ...

    def norm_parameters(self) -> list[nn.Parameter]: ...

    def chunks(self) -> list[Decoder]: ...


def dense_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy over full-vocabulary logits [N, V] (0 where ignored)."""
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")


def shifted_loss_sum(logits: torch.Tensor, labels: torch.Tensor,
                     token_loss: TokenLoss = dense_token_loss) -> torch.Tensor:
    """Sum of next-token losses: logits[:, :-1] predict labels[:, 1:]; -100 labels are skipped."""
    return token_loss(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).sum()


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on the compute device, or nothing for fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class LocalEngine:
    """One process, one whole model: gradient accumulation over the step's micro-batches."""

    def __init__(self, decoder: Decoder, device: torch.device, dtype: torch.dtype):
        self.decoder = decoder
        self.model = decoder.module
        self.device = device
        self.dtype = dtype

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def norm_parameters(self) -> list[nn.Parameter]:
        return self.parameters()

    def chunks(self) -> list[Decoder]:
        """The model pieces this process runs: here the whole decoder."""
        return [self.decoder]

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch]) -> StepResult:
        """Forward-only token-weighted mean loss over the micro-batches (model in eval mode)."""
        self.model.eval()
        try:
            sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, label tokens
            for mb in micro_batches:
                with autocast(self.device, self.dtype):
                    logits, _ = self.decoder(input_ids=mb.input_ids.to(self.device))
                labels = mb.labels.to(self.device)
                sums += torch.stack([shifted_loss_sum(logits, labels).double(), mb.label_tokens().double()])
        finally:
            self.model.train()
        loss_sum, tokens = sums.tolist()
        return StepResult(loss_sum / max(tokens, 1), 0.0, int(tokens))

    def step(self, micro_batches: list[MicroBatch], trace: bool = False) -> StepResult:
        """Accumulate gradients over the micro-batches; `trace` has nothing to time in one process."""
        tokens = sum(mb.num_label_tokens() for mb in micro_batches)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss, aux: read once per step
        for mb in micro_batches:
            with autocast(self.device, self.dtype):
                logits, aux = self.decoder(input_ids=mb.input_ids.to(self.device))
            ce = shifted_loss_sum(logits, mb.labels.to(self.device))
            del logits  # they die with the backward, not when the next forward rebinds the name (peak memory)
            (ce / max(tokens, 1) + aux / len(micro_batches)).backward()
            sums += torch.stack([ce.detach(), aux.detach()]).double()
        loss_sum, aux_sum = sums.tolist()
        return StepResult(loss_sum / max(tokens, 1), aux_sum / len(micro_batches), tokens)
