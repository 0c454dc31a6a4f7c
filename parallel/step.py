"""The step contract between the trainer and any engine: micro-batches in, a StepResult out, gradients left
on the parameters; the Objective the last stage calls. Also the token loss and autocast every engine shares, and the
single-process engine."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from parallel.blockwise_ce import cross_entropy_rows
from parallel.decoder import Decoder
from parallel.generation import Rollout, Sampling, Sequences, check_prompts, completions, generation_mode, rollout

IGNORE_INDEX = -100  # labels with this value do not enter the loss (torch cross-entropy default)
TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def target_counts(labels: torch.Tensor) -> torch.Tensor:
    """Per row of [B, S] labels: how many enter the shifted loss (position 0 is never a target)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)


@dataclass
class MicroBatch:
    """One micro-batch: token ids and (unshifted) labels of the same shape, and the objective's payload.

    `global_tokens` is what the loss of the whole global step this micro-batch belongs to (every DP replica's
    micro-batches) is a mean over, when the data layer knows it: the objective's count (label tokens, say); with it
    the engine needs no collective to scale the loss (like transformers' `num_items_in_batch`). Every micro-batch of
    a step carries the same value. `extra` is whatever else the objective reads (per-row tensors, say): the engine
    hands it to the last stage's objective untouched."""

    input_ids: torch.Tensor  # [B, S] long
    labels: torch.Tensor  # [B, S] long, -100 = ignored, NOT shifted (the model shifts)
    global_tokens: int | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def label_tokens(self) -> torch.Tensor:
        """Number of labels that enter the shifted loss (position 0 is never a target), as a tensor."""
        return target_counts(self.labels).sum()

    def num_label_tokens(self) -> int:
        """`label_tokens` as a Python int (a host sync: not for the per-micro-batch hot path)."""
        return int(self.label_tokens())


@dataclass
class StepResult:
    """What one optimizer step's forward/backward produced, identical on every rank."""

    loss: float  # the objective's loss, a mean over its count in the global batch
    aux_loss: float  # MoE load-balancing loss, mean over the global batch's micro-batches
    tokens: int  # the objective's count in the global batch (label tokens, say): what the loss is a mean over
    trace: Any = None  # with `trace=True`: every rank's timed actions on global rank 0, else None
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's own means


class Engine(Protocol):
    """Runs forward and backward of one step; leaves summed, synchronised gradients on the parameters."""

    def step(self, micro_batches: list[MicroBatch], trace: bool = False) -> StepResult: ...

    def evaluate(self, micro_batches: list[MicroBatch]) -> StepResult: ...

    def forward_sums(self, micro_batches: list[MicroBatch], objective: Objective) -> torch.Tensor: ...

    def named_parameters(self) -> dict[str, nn.Parameter]: ...

    def parameters(self) -> list[nn.Parameter]: ...

    def norm_parameters(self) -> list[nn.Parameter]: ...

    def chunks(self) -> list[Decoder]: ...

    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
                 first_row: int | None = None) -> Rollout:
        """Complete this DP replica's left-padded prompts [B, P] (called by every rank; every rank of the replica
        returns the same Rollout); no gradients, the model in eval mode for the call. Sampling numbers the rows from
        `first_row` (default: as if the replicas' prompts were stacked in DP-rank order)."""
        ...


def dense_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 cross-entropy over full-vocabulary logits [N, V] (0 where ignored); bf16 logits are upcast a
    block of rows at a time (no fp32 copy of them all is kept per in-flight micro-batch)."""
    return cross_entropy_rows(logits, targets, IGNORE_INDEX)


class Objective(Protocol):
    """What the last stage makes of one micro-batch's logits, and what the step's loss is a mean over.

    A call gets the logits (vocab-sharded under TP), the labels, the micro-batch's `extra` as the data layer left
    it, and the layout's token loss (so it needs no TP of its own). It returns the loss sum that backward starts
    from (the engine scales it by 1 / the global count) and the micro-batch's detached sums, `width` of them, entry
    0 the loss sum; the engine adds them up over micro-batches, stages and DP replicas in float64, and `metrics`
    turns the totals into the objective's logged means."""

    width: int

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor],
                 token_loss: TokenLoss) -> tuple[torch.Tensor, torch.Tensor]: ...

    def count(self, micro_batch: MicroBatch) -> torch.Tensor: ...

    def metrics(self, sums: list[float], count: int) -> dict[str, float]: ...


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on the compute device, or nothing for fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class LocalEngine:
    """One process, one whole model: gradient accumulation over the step's micro-batches."""

    def __init__(self, decoder: Decoder, device: torch.device, dtype: torch.dtype, objective: Objective):
        self.decoder = decoder
        self.model = decoder.module
        self.device = device
        self.dtype = dtype
        self.objective = objective

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def norm_parameters(self) -> list[nn.Parameter]:
        return self.parameters()

    def chunks(self) -> list[Decoder]:
        """The model pieces this process runs: here the whole decoder."""
        return [self.decoder]

    def _loss(self, logits: torch.Tensor, mb: MicroBatch,
              objective: Objective | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return (objective or self.objective)(logits, mb.labels.to(self.device, non_blocking=True), mb.extra,
                                            dense_token_loss)

    @torch.no_grad()
    def forward_sums(self, micro_batches: list[MicroBatch], objective: Objective) -> torch.Tensor:
        """Forward only (model in eval mode): `objective`'s sums over the micro-batches, float64 on the device."""
        sums = torch.zeros(objective.width, dtype=torch.float64, device=self.device)
        self.model.eval()
        try:
            for mb in micro_batches:
                with autocast(self.device, self.dtype):
                    logits, _ = self.decoder(input_ids=mb.input_ids.to(self.device))
                    sums += self._loss(logits, mb, objective)[1].double()
        finally:
            self.model.train()
        return sums

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
                 first_row: int | None = None) -> Rollout:
        """Prefill, then one token per step over the family's key/value cache, every row in one batch."""
        check_prompts(prompts, prompt_mask, sampling, getattr(self.decoder.config, "max_position_embeddings", None))
        ids, first = prompts.to(self.device), first_row or 0
        seqs = Sequences(prompt_mask.to(self.device).bool(), list(range(first, first + len(prompts))),
                         self.decoder.adapter.new_cache())
        with generation_mode([self.model]):
            for step in range(sampling.max_new_tokens):
                with autocast(self.device, self.dtype):
                    logits, _ = self.decoder(input_ids=ids, **seqs.forward_args(ids.shape[1]), logits_to_keep=1)
                seqs.advance(ids.shape[1])
                ids = seqs.sample(logits[:, -1], sampling, step)
                if seqs.done:
                    break
        return rollout(prompts, prompt_mask, *completions([seqs], len(seqs.tokens), sampling.pad_token_id), sampling)

    def evaluate(self, micro_batches: list[MicroBatch]) -> StepResult:
        """Forward-only loss over the micro-batches (model in eval mode), a mean over the objective's count."""
        count = sum(int(self.objective.count(mb)) for mb in micro_batches)
        values = self.forward_sums(micro_batches, self.objective).tolist()
        return StepResult(values[0] / max(count, 1), 0.0, count, metrics=self.objective.metrics(values, count))

    def step(self, micro_batches: list[MicroBatch], trace: bool = False) -> StepResult:
        """Accumulate gradients over the micro-batches; `trace` has nothing to time in one process."""
        tokens = local_tokens(micro_batches, self.objective.count, self.device)
        scale = max(tokens, 1) if isinstance(tokens, int) else tokens.clamp(min=1)  # the same float32 division
        width = self.objective.width
        sums = torch.zeros(width + 1, dtype=torch.float64, device=self.device)  # the objective's, aux: read once
        for mb in micro_batches:
            with autocast(self.device, self.dtype):
                logits, aux = self.decoder(input_ids=mb.input_ids.to(self.device, non_blocking=True))
            loss_sum, parts = self._loss(logits, mb)
            del logits  # they die with the backward, not when the next forward rebinds the name (peak memory)
            (loss_sum / scale + aux / len(micro_batches)).backward()
            sums += torch.cat([parts, aux.detach().view(1)]).double()
        *values, aux_sum, count = read_back(sums, tokens)
        count = int(count)
        return StepResult(values[0] / max(count, 1), aux_sum / len(micro_batches), count,
                          metrics=self.objective.metrics(values, count))


def local_tokens(micro_batches: list[MicroBatch], count: Callable[[MicroBatch], torch.Tensor],
                 device: torch.device) -> int | torch.Tensor:
    """The objective's count: the data layer's stamp (the global batch's) as a host int, else these micro-batches'
    sum as a device tensor (no host read: `read_back` reads it with the loss). Every micro-batch of a step carries
    the same stamp."""
    stamps = {mb.global_tokens for mb in micro_batches}
    if None in stamps:
        return torch.stack([count(mb) for mb in micro_batches]).sum().to(device, non_blocking=True)
    if len(stamps) != 1:
        raise ValueError(f"the micro-batches of one step carry different global token counts {sorted(stamps)}")
    return stamps.pop()


def read_back(sums: torch.Tensor, tokens: int | torch.Tensor) -> list[float]:
    """The step's one host read: the float64 `sums`, then the token count (a host int needs no read)."""
    if isinstance(tokens, int):
        return [*sums.tolist(), tokens]
    return torch.cat([sums, tokens.double().view(1)]).tolist()
