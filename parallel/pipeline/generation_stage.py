"""A generation schedule's stage: the runtime calls its `forward` as it calls a training Stage's, one tick of one
micro-batch of sequences at a time, over that micro-batch's key/value cache on this stage."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallel.decoder import Decoder
from parallel.generation import Sampling, Sequences, VocabGather
from parallel.step import autocast

from .actions import Action, Kind
from .transport import BoundaryMismatch, Message


@dataclass
class Round:
    """One run of the generation list: its first generation step, how many ticks it runs, and the micro-batches it
    runs (those with a row still before EOS), in order: unit u is micro-batch active[u % len(active)]."""

    first_step: int
    ticks: int
    active: tuple[int, ...]


@dataclass
class GenerationBoundary:
    """What each message of a round carries: hidden states [rows of the micro-batch, tokens, hidden] in float32 (the
    whole prompt at prefill, else one token), or a sampled token [rows, 1] long."""

    rows: list[int]  # rows per micro-batch of the round
    width: int  # tokens at the round's first tick (the prompt length in the first round, else 1)
    hidden: int

    def shape_dtype(self, action: Action) -> tuple[tuple[int, ...], torch.dtype]:
        m = len(self.rows)
        rows = self.rows[action.microbatch % m]
        if action.kind in (Kind.SEND_T, Kind.RECV_T):
            return (rows, 1), torch.long
        return (rows, self.width if action.microbatch < m else 1, self.hidden), torch.float32

    def empty(self, action: Action, device: torch.device) -> torch.Tensor:
        shape, dtype = self.shape_dtype(action)
        return torch.empty(shape, dtype=dtype, device=device)

    def check(self, msg: Message) -> None:
        shape, dtype = self.shape_dtype(msg.action)
        if tuple(msg.tensor.shape) != shape or msg.tensor.dtype != dtype:
            raise BoundaryMismatch(f"{msg.action} sends {tuple(msg.tensor.shape)} {msg.tensor.dtype}; the generation "
                                   f"boundary is {shape} {dtype}")


@dataclass
class GenerationStage:
    """One stage's chunk over its micro-batches' caches; the last stage samples with the full vocabulary's logits."""

    chunk: Decoder
    index: int
    n_stages: int
    device: torch.device
    dtype: torch.dtype
    sequences: list[Sequences]  # per micro-batch: this stage's cache, positions and mask (and samples, last stage)
    sampling: Sampling
    gather: VocabGather  # the last stage's vocab-sharded logits -> the full vocabulary's
    handoff: dict[int, torch.Tensor]  # unit -> its input token, where the first and last stage share a rank
    first_here: bool = False  # the first stage is on this rank too (pp 1, or a V placement): tokens stay here
    round: Round = field(default_factory=lambda: Round(0, 1, (0,)))

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def forward(self, unit: int, inputs: torch.Tensor, labels: torch.Tensor | None, loss_scale: float,
                aux_scale: float, extra: dict | None = None) -> torch.Tensor | None:
        """Tick `unit // M` of micro-batch `active[unit % M]` (M active micro-batches): the stage's output (hidden
        states, or the sampled token [b, 1] to send to the first stage), or None where nothing leaves the rank."""
        m = len(self.round.active)
        tick, j = divmod(unit, m)
        seqs = self.sequences[self.round.active[j]]
        if self.is_first and tick:
            inputs = self.handoff.pop(unit, inputs)  # the token of the previous tick: handed over here, or received
        width = inputs.shape[1]
        with autocast(self.device, self.dtype):
            args = seqs.forward_args(width)
            if self.is_first:
                out, _ = self.chunk(input_ids=inputs.to(self.device), **args, logits_to_keep=1)
            else:
                out, _ = self.chunk(hidden=inputs, **args, logits_to_keep=1)
        seqs.advance(width)
        if not self.is_last:
            return out
        token = seqs.sample(self.gather(out[:, -1]), self.sampling, self.round.first_step + tick)
        if tick + 1 == self.round.ticks:
            return None  # the round's last token: the engine carries it to the next round's first tick
        if self.first_here:
            self.handoff[unit + m] = token
            return None
        return token
