"""Transport: moves boundary tensors (activations forward, gradients backward) between pipeline ranks.

`post` starts a batch of sends and receives and returns at once with one `Pending` per message; the runtime
decides when to wait. Two implementations: torch.distributed P2P, and in-process channels for emulation.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from .actions import Action, Kind, counterpart

SENDS = (Kind.SEND_F, Kind.SEND_B, Kind.SEND_T)


@dataclass
class Message:
    """One boundary transfer: the comm action, the peer's rank, and the tensor for a send."""

    action: Action
    peer: int
    tensor: torch.Tensor | None = None


class Pending(Protocol):
    """One posted transfer. For a receive, `tensor` is valid once ready; a send's tensor may go once ready."""

    message: Message
    tensor: torch.Tensor | None

    def ready(self) -> bool:
        """True when the transfer needs no more waiting (never blocks)."""
        ...

    def wait(self) -> None:
        """Make `tensor` safe to use: block until ready (gloo), or order the device's current stream after the
        transfer and return at once (NCCL: the host never polls; the watchdog asks `ready()` to catch a hang).
        Raise TransportTimeout naming the transfer when a blocking wait takes too long."""
        ...


class Transport(Protocol):
    """Posts a batch of sends and receives together, without waiting for any of them.

    A transport may set `receives_early = True` when a posted receive never holds up another transfer; the
    runtime then posts receives ahead of the list (absent or False: exactly where the list places them)."""

    def post(self, messages: list[Message]) -> list[Pending]: ...


class TransportTimeout(RuntimeError):
    """A boundary transfer did not complete in time; the message names peer, direction and micro-batch."""


class BoundaryMismatch(RuntimeError):
    """A boundary tensor whose shape or dtype differs from the one both stages agreed on from the config."""


@dataclass(frozen=True)
class Boundary:
    """The stage-boundary tensor every transfer carries: [micro_batch_size, seq_len, hidden], one dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def empty(self, action: Action, device: torch.device) -> torch.Tensor:
        """The buffer a receive lands in."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def check(self, msg: Message) -> None:
        """Refuse to send a tensor the receiver would misread (garbage) or wait on forever (a hang)."""
        tensor = msg.tensor
        if tuple(tensor.shape) == self.shape and tensor.dtype == self.dtype:
            return
        what = "activation" if msg.action.kind is Kind.SEND_F else "gradient"
        peer = counterpart(msg.action).stage
        raise BoundaryMismatch(
            f"stage {msg.action.stage} sends stage {peer} a {what} of shape {tuple(tensor.shape)} {tensor.dtype} "
            f"for micro-batch {msg.action.microbatch}, but the boundary is {self.shape} {self.dtype} "
            "(micro_batch_size, seq_len, hidden_size): a stage module changed the hidden-state shape or dtype")


DIRECTION = {Kind.SEND_F: "sending activation to", Kind.RECV_F: "receiving activation from",
             Kind.SEND_B: "sending gradient to", Kind.RECV_B: "receiving gradient from",
             Kind.SEND_T: "sending the sampled token to", Kind.RECV_T: "receiving the sampled token from"}


def describe(rank: int, msg: Message) -> str:
    """'rank 1: receiving activation from rank 0 for micro-batch 3 (stage 1, RECV_F3@s1)'."""
    return (f"rank {rank}: {DIRECTION[msg.action.kind]} rank {msg.peer} for micro-batch "
            f"{msg.action.microbatch} (stage {msg.action.stage}, {msg.action})")


# --- torch.distributed point-to-point ------------------------------------------------------------------


@dataclass
class P2PPending:
    """A posted isend/irecv; for a receive, `tensor` is the buffer it lands in."""

    message: Message
    tensor: torch.Tensor | None
    works: list  # one work per op, or the batch's coalesced work(s) under NCCL
    transport: "P2PTransport"
    waited: bool = False  # known complete
    ordered: bool = False  # the device stream waits for it (NCCL), complete or not

    def ready(self) -> bool:
        # The runtime asks about every posted send before each compute: answer from the flag once known.
        if not self.waited:
            for work in self.works:
                if not work.is_completed():
                    return False
            self.waited = True
        return True

    def wait(self) -> None:
        if self.waited or self.ordered:
            return
        for work in self.works:
            self.transport.wait(work, self.message)
        self.ordered = self.transport.stream_ordered
        self.waited = not self.ordered  # in stream order only: ready() asks the device when it is asked


class P2PTransport:
    """torch.distributed point-to-point transport; shapes and dtype are known from the config (no handshake)."""

    def __init__(self, rank: int, boundary: Boundary, device: torch.device, timeout_s: float):
        self.rank = rank
        self.boundary = boundary
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        # gloo (CPU tensors) progresses every op on its own; NCCL runs a peer pair's ops on one stream in
        # posting order, where a receive posted early could hold up a send the peer waits for.
        self.receives_early = device.type == "cpu"
        # NCCL's wait() without a timeout only makes the current stream wait for the transfer; with one it sleep-polls
        # the host until the transfer lands, and the device drains at every hop.
        self.stream_ordered = device.type == "cuda"

    def post(self, messages: list[Message]) -> list[Pending]:
        if self.device.type == "cpu":
            return self._post_each(messages)
        ops, tensors = [], []
        for msg in messages:
            tensor = self._tensor(msg)
            ops.append(dist.P2POp(dist.isend if msg.action.kind in SENDS else dist.irecv, tensor, msg.peer))
            tensors.append(tensor)
        works = dist.batch_isend_irecv(ops)
        # NCCL coalesces the batch into one work (or fewer than the ops), and then every op waits for all of it.
        per_op = [[work] for work in works] if len(works) == len(ops) else [list(works)] * len(ops)
        return [P2PPending(msg, tensor, w, self) for msg, tensor, w in zip(messages, tensors, per_op)]

    def _post_each(self, messages: list[Message]) -> list[Pending]:
        """CPU tensors go over gloo, which has no batched P2P: `batch_isend_irecv` would only loop over
        isend/irecv, at a few checks per op that add up in schedules with many lone sends. Post each op on the
        default group directly (its ranks are the global ranks that `peer` names), in list order."""
        group = dist.group.WORLD
        posted = []
        for msg in messages:
            tensor = self._tensor(msg)
            if msg.action.kind in SENDS:
                work = group.send([tensor], msg.peer, 0)
            else:
                work = group.recv([tensor], msg.peer, 0)
            posted.append(P2PPending(msg, tensor, [work], self))
        return posted

    def _tensor(self, msg: Message) -> torch.Tensor:
        """A send's tensor (checked against the boundary) or a fresh receive buffer."""
        if msg.action.kind in SENDS:
            self.boundary.check(msg)
            return msg.tensor.contiguous()
        return self.boundary.empty(msg.action, self.device)

    def wait(self, work: dist.Work, msg: Message) -> None:
        """Wait for one transfer (in stream order under NCCL); on timeout or a dead peer raise naming it."""
        try:
            completed = work.wait() if self.stream_ordered else work.wait(timeout=self.timeout)
        except RuntimeError as error:
            raise TransportTimeout(f"{describe(self.rank, msg)} failed after at most "
                                   f"{self.timeout.total_seconds():.0f}s: {str(error).splitlines()[0]}") from error
        if completed is False:
            raise TransportTimeout(f"{describe(self.rank, msg)} did not complete within "
                                   f"{self.timeout.total_seconds():.0f}s (parallel.timeout_s)")


# --- in-process channels (emulation) ---------------------------------------------------------------------


class EmulationError(RuntimeError):
    """The emulated ranks deadlocked or exchanged mismatched messages; the message names ranks and slots."""


@dataclass
class LocalPending:
    """A transfer between two emulated ranks; a send is ready at once (the channel buffers it)."""

    message: Message
    tensor: torch.Tensor | None = None
    matched: bool = False

    def ready(self) -> bool:
        return self.matched

    def wait(self) -> None:
        if not self.matched:  # a single thread cannot wait; the cooperative scheduler switches ranks instead
            raise EmulationError(f"waiting on an unmatched in-process transfer: {self.message}")


@dataclass
class _Channel:
    """Messages from one rank to another, matched first-in first-out as NCCL and gloo match them."""

    sends: deque = field(default_factory=deque)  # (action, tensor) not yet received
    recvs: deque = field(default_factory=deque)  # LocalPending receives not yet matched


class LocalTransport:
    """All pipeline ranks of one process share these channels; `endpoint(rank)` is one rank's Transport."""

    def __init__(self, boundary: Boundary | None = None, mate: Callable[[Action], Action] = counterpart) -> None:
        self.channels: dict[tuple[int, int], _Channel] = {}
        self.boundary = boundary  # checked on every send, as the P2P transport does
        self.mate = mate  # the receive a send pairs with (generation's token hop is no neighbour's)

    def endpoint(self, rank: int) -> "LocalEndpoint":
        return LocalEndpoint(self, rank)

    def channel(self, src: int, dst: int) -> _Channel:
        return self.channels.setdefault((src, dst), _Channel())

    def unconsumed(self) -> list[str]:
        """Messages sent but never received (a clean step leaves none)."""
        return [f"{a} from rank {src} to rank {dst}" for (src, dst), ch in self.channels.items() for a, _ in ch.sends]


@dataclass
class LocalEndpoint:
    """One emulated rank's view of the shared channels."""

    hub: LocalTransport
    rank: int

    def post(self, messages: list[Message]) -> list[Pending]:
        posted = []
        for msg in messages:
            if msg.action.kind in SENDS:
                if self.hub.boundary is not None:
                    self.hub.boundary.check(msg)
                # A copy, as a wire would make: the receiver owns its buffer and the sender may free its own.
                channel = self.hub.channel(self.rank, msg.peer)
                channel.sends.append((msg.action, msg.tensor.detach().clone()))
                pending = LocalPending(msg, msg.tensor, matched=True)
            else:
                channel = self.hub.channel(msg.peer, self.rank)
                pending = LocalPending(msg)
                channel.recvs.append(pending)
            _match(channel, self.hub.mate)
            posted.append(pending)
        return posted


def _match(channel: _Channel, mate: Callable[[Action], Action]) -> None:
    """Pair the oldest unmatched send with the oldest unmatched receive, as a real channel would."""
    while channel.sends and channel.recvs:
        (sent, tensor), recv = channel.sends.popleft(), channel.recvs.popleft()
        if mate(sent) != recv.message.action:
            raise EmulationError(f"messages out of order: rank {recv.message.peer} sent {sent} first, but the oldest "
                                 f"receive posted for it is {recv.message.action} (channels match in posting order)")
        recv.tensor, recv.matched = tensor, True
