"""Transport: moves boundary tensors (activations forward, gradients backward) between pipeline ranks."""

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from .actions import Action, Kind


@dataclass
class Message:
    """One boundary transfer: the comm action, the peer's global rank, and the tensor for a send."""

    action: Action
    peer: int
    tensor: torch.Tensor | None = None


class Transport(Protocol):
    """Posts a batch of sends and receives together and returns the received tensors by action."""

    def exchange(self, messages: list[Message]) -> dict[Action, torch.Tensor]: ...


class TransportTimeout(RuntimeError):
    """A boundary transfer did not complete in time; the message names peer, direction and micro-batch."""


DIRECTION = {Kind.SEND_F: "sending activation to", Kind.RECV_F: "receiving activation from",
             Kind.SEND_B: "sending gradient to", Kind.RECV_B: "receiving gradient from"}


class P2PTransport:
    """torch.distributed point-to-point transport; shapes and dtype are known from the config (no handshake)."""

    def __init__(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 timeout_s: float):
        self.rank = rank
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)

    def exchange(self, messages: list[Message]) -> dict[Action, torch.Tensor]:
        ops, received = [], {}
        for msg in messages:
            if msg.action.kind in (Kind.SEND_F, Kind.SEND_B):
                ops.append(dist.P2POp(dist.isend, msg.tensor.contiguous(), msg.peer))
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, msg.peer))
                received[msg.action] = buffer
        for work, msg in zip(dist.batch_isend_irecv(ops), messages):
            self._wait(work, msg)
        return received

    def _wait(self, work: dist.Work, msg: Message) -> None:
        """Wait for one transfer; on timeout or a dead peer raise naming what we waited for."""
        what = (f"rank {self.rank}: {DIRECTION[msg.action.kind]} rank {msg.peer} for micro-batch "
                f"{msg.action.microbatch} (stage {msg.action.stage}, {msg.action})")
        try:
            completed = work.wait(timeout=self.timeout)
        except RuntimeError as error:
            raise TransportTimeout(f"{what} failed after at most {self.timeout.total_seconds():.0f}s: "
                                   f"{str(error).splitlines()[0]}") from error
        if completed is False:
            raise TransportTimeout(f"{what} did not complete within {self.timeout.total_seconds():.0f}s "
                                   "(parallel.timeout_s)")
