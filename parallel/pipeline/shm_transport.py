"""Shared-memory transport: boundary tensors between pipeline ranks on one host, for CPU tensors.

Hand-written because the field has no low-latency same-host P2P for CPU tensors: gloo hands every message to its
own I/O thread, which then wakes the waiting thread, two wake-ups a hop where one does. Measured here: a hop
7-10% shorter (`python scripts/bench/hop_latency.py`; most of either is an idle CPU waking up), and sleep
benchmark steps at pp=4, m=8 a few ms shorter (`python scripts/bench/schedules.py`: Sluice vs Sluice on gloo).

Each ordered pair of ranks shares a ring of slots in the sender's memory (a memfd, mapped by both; no file is left
behind, even by a killed process) and one Unix socket pair:
- a send copies the tensor into the next slot and writes b"M" on the socket; it is done at once;
- a receive waits in poll() on the socket, copies its slot out and writes back b"A", which frees the slot.
A sender whose ring is full waits for an ack. That is deadlock-free for the lowered lists: it waits only for a
message the batch model (runtime.py) had delivered before this send's batch was posted. A rank that exits
closes its sockets, so its peers fail at once with a message naming it, not after the timeout.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .actions import Action
from .transport import SENDS, Boundary, Message, TransportTimeout, describe

MESSAGE, ACK = b"M", b"A"
MAX_SLOTS = 16  # a ring per peer holds this many boundary tensors at most; more in flight waits for acks
RING_BYTES = 64 << 20  # and this many bytes (one slot at least): big boundaries get fewer slots


def shm_available() -> bool:
    """This platform can share a memfd over a Unix socket (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX")


@dataclass
class ShmPending:
    """A posted transfer; a send is done when posted, a receive once its slot is copied out."""

    message: Message
    tensor: torch.Tensor | None
    link: "_Link"
    transport: "ShmTransport"
    done: bool = False

    def ready(self) -> bool:
        if not self.done:
            self.transport.progress(self.link)
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.transport.wait_for(self)


@dataclass
class _Link:
    """The connection to one peer: the socket, both rings, and the receives waiting for a message."""

    peer: int
    sock: socket.socket
    tx: list[torch.Tensor]  # our ring's slots (byte views), written by us
    rx: list[torch.Tensor]  # the peer's ring, read by us
    sent: int = 0  # messages written into our ring
    acked: int = 0  # of them, taken by the peer
    taken: int = 0  # messages read from the peer's ring
    arrived: int = 0  # messages the peer announced that no receive has taken yet
    receives: deque[ShmPending] = field(default_factory=deque)  # posted receives, oldest first
    closed: bool = False  # the peer closed its end: it exited (or failed)


class ShmTransport:
    """Pipeline P2P over shared memory between the ranks of one host, over `links` by peer (global rank);
    `shm_transport` sets them up, every rank of the world together."""

    receives_early = True  # a posted receive never holds up a transfer (sends never wait for receives)

    def __init__(self, rank: int, boundary: Boundary, timeout_s: float, links: dict[int, _Link]):
        self.rank, self.boundary, self.timeout_s, self.links = rank, boundary, timeout_s, links
        self.poller = select.poll()  # not select(): a busy process's descriptors may pass FD_SETSIZE (1024)
        for link in links.values():
            self.poller.register(link.sock, select.POLLIN)

    def post(self, messages: list[Message]) -> list[ShmPending]:
        posted = []
        for msg in messages:
            link = self.links[msg.peer]
            if msg.action.kind in SENDS:
                self.boundary.check(msg)
                self._send(link, msg)
                posted.append(ShmPending(msg, msg.tensor, link, self, done=True))
            else:
                pending = ShmPending(msg, torch.empty(self.boundary.shape, dtype=self.boundary.dtype), link, self)
                link.receives.append(pending)
                posted.append(pending)
        return posted

    def _send(self, link: _Link, msg: Message) -> None:
        """Copy into the next free slot (waiting for an ack if the ring is full) and announce it."""
        if link.sent - link.acked >= len(link.tx):
            self._block(msg, lambda: link.sent - link.acked < len(link.tx) or self._gone(link, msg))
        link.tx[link.sent % len(link.tx)].copy_(_bytes(msg.tensor))
        link.sent += 1
        try:
            link.sock.sendall(MESSAGE)
        except OSError:  # EPIPE, ECONNRESET: the peer is gone
            self._closed(link)
            self._gone(link, msg)

    def progress(self, link: _Link) -> None:
        """Read what the peer wrote (announcements and acks) and fill the receives it completes; never blocks.
        Raises, naming the oldest receive, if the peer is gone and it cannot be filled."""
        if not link.closed and self._read(link) is None:
            self._closed(link)  # what it sent before it went is still in its ring, ours to take
        taken = 0
        while link.arrived and link.receives:
            pending = link.receives.popleft()
            _bytes(pending.tensor).copy_(link.rx[link.taken % len(link.rx)])
            link.taken += 1
            link.arrived -= 1
            pending.done = True
            taken += 1
        if link.closed and link.receives:
            self._gone(link, link.receives[0].message)
        if taken and not link.closed:
            try:
                link.sock.sendall(ACK * taken)
            except OSError:  # a peer that finished its step and exited needs no ack
                self._closed(link)

    @staticmethod
    def _read(link: _Link) -> bool | None:
        """Count the notes the peer wrote so far: True if any, False if none yet, None once it closed its end."""
        try:
            data = link.sock.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:  # ECONNRESET: closed with our acks unread
            return None
        if not data:
            return None
        link.arrived += data.count(MESSAGE)
        link.acked += data.count(ACK)
        return True

    def _closed(self, link: _Link) -> None:
        """The peer closed its end: count the notes it wrote before (a failed write may be the first sign of its
        exit), then stop polling a socket that would now always be readable."""
        if not link.closed:
            while self._read(link):
                pass
            link.closed = True
            self.poller.unregister(link.sock)

    def _gone(self, link: _Link, msg: Message) -> bool:
        """Raise for a peer that closed its connection while this rank still needs it; False if it is there."""
        if not link.closed:
            return False
        raise TransportTimeout(f"{describe(self.rank, msg)} failed: rank {link.peer} closed its connection "
                               "(it exited or failed; its own error says why)")

    def wait_for(self, pending: ShmPending) -> None:
        """Block until `pending` is filled; raise naming it on timeout or when a peer is gone."""
        self._block(pending.message, lambda: pending.done)

    def _block(self, msg: Message, until) -> None:
        """Progress every link (a peer may be waiting for our acks) and sleep in poll() until `until()`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            for link in self.links.values():
                self.progress(link)
            if until():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout(f"{describe(self.rank, msg)} did not complete within {self.timeout_s:.0f}s "
                                       "(parallel.timeout_s)")
            self.poller.poll(left * 1000)

    def close(self) -> None:
        """Close every socket (a peer's next read sees it); the rings go with the last tensor viewing them."""
        for link in self.links.values():
            link.sock.close()
        self.links = {}


def boundary_bytes(boundary: Boundary) -> int:
    """Bytes of one boundary tensor (one ring slot)."""
    return torch.empty(boundary.shape, dtype=boundary.dtype, device="meta").nbytes


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (any dtype)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def send_counts(actions: list[Action], peer_of) -> dict[int, int]:
    """Sends to each peer in one rank's list; receives count the peer too, so every peer has an entry."""
    counts: dict[int, int] = {}
    for action in actions:
        if action.kind.is_comm:
            peer = peer_of(action)
            counts[peer] = counts.get(peer, 0) + (action.kind in SENDS)
    return counts


def shm_transport(rank: int, boundary: Boundary, timeout_s: float, slots: dict[int, int],
                  required: bool) -> ShmTransport | None:
    """The shared-memory transport when every rank of the world is on this host, else None (or, if `required`,
    a ValueError naming the hosts). A collective: every rank of the world calls it, peers or not.

    `slots` maps each pipeline peer (global rank) to the ring size toward it (its sends in a step)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"\0sluice-{uuid.uuid4().hex}"  # Linux's abstract namespace: no file to clean up
    listener.bind(address)
    listener.listen(max(len(slots), 1))
    try:
        box: list = [None] * dist.get_world_size()
        dist.all_gather_object(box, _Endpoint(socket.gethostname(), _machine(), os.getpid(), address))
        if len({e.machine for e in box}) > 1:  # every listener is bound once the gather returns
            if required:
                hosts = sorted({e.host for e in box})
                raise ValueError(f"parallel.transport=shm needs every rank on one host (and network namespace), but "
                                 f"they run on {hosts}; use parallel.transport=auto or p2p")
            return None
        nbytes = boundary_bytes(boundary)
        return ShmTransport(rank, boundary, timeout_s, _connect(rank, slots, nbytes, timeout_s, listener, box))
    finally:
        listener.close()


@dataclass(frozen=True)
class _Endpoint:
    """What a rank tells every other at set-up: where it runs and where it listens."""

    host: str
    machine: tuple[str, int]  # boot id and network namespace: one host, and one namespace for Unix sockets
    pid: int
    address: str


def _machine() -> tuple[str, int]:
    """This process's kernel (boot id) and network namespace; hostnames alone repeat across containers."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return boot, os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return socket.gethostname(), 0


def _connect(rank: int, slots: dict[int, int], nbytes: int, timeout_s: float, listener: socket.socket,
             endpoints: list[_Endpoint]) -> dict[int, _Link]:
    """A socket and two rings with every peer: connect to the lower ranks, accept the higher ones (a process
    that is not the rank it claims to be is turned away: any local process can reach an abstract socket)."""
    links: dict[int, _Link] = {}
    for peer in sorted(p for p in slots if p < rank):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(endpoints[peer].address)
        except OSError as error:
            raise ValueError(f"rank {rank}: parallel.transport=shm cannot reach rank {peer} on this host ({error}; "
                             "ranks in separate containers or network namespaces do not share Unix sockets): "
                             "use parallel.transport=p2p") from error
        sock.sendall(rank.to_bytes(4, "little"))
        links[peer] = _open_link(sock, peer, slots[peer], nbytes)
    deadline = time.monotonic() + timeout_s
    expected = {p for p in slots if p > rank}
    while expected - links.keys():
        listener.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock, _ = listener.accept()
        except TimeoutError as error:
            missing = sorted(expected - links.keys())
            raise TransportTimeout(f"rank {rank}: rank(s) {missing} did not connect to the shared-memory transport "
                                   f"within {timeout_s:.0f}s (parallel.timeout_s)") from error
        sock.settimeout(timeout_s)
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        try:
            peer = int.from_bytes(_read_exactly(sock, 4), "little")
        except (OSError, RuntimeError):
            peer = -1
        if peer not in expected or peer in links or endpoints[peer].pid != pid:
            sock.close()  # not the rank it claims to be
            continue
        links[peer] = _open_link(sock, peer, slots[peer], nbytes)
    for link in links.values():
        link.sock.settimeout(None)  # blocking writes of a byte; reads never block (MSG_DONTWAIT, poll)
    return links


def _open_link(sock: socket.socket, peer: int, slots: int, nbytes: int) -> _Link:
    """Create our ring toward `peer`, hand it over with its size, and map the ring the peer hands us."""
    slots = max(1, min(slots, MAX_SLOTS, RING_BYTES // nbytes))
    fd = os.memfd_create(f"sluice-ring-to-{peer}")
    try:
        os.ftruncate(fd, slots * nbytes)
        ours = mmap.mmap(fd, slots * nbytes)
        socket.send_fds(sock, [slots.to_bytes(4, "little")], [fd])
    finally:
        os.close(fd)
    data, fds, _, _ = socket.recv_fds(sock, 4, 1)
    if len(data) != 4 or len(fds) != 1:
        raise RuntimeError(f"rank {peer} did not hand over its shared-memory ring (got {len(fds)} descriptors)")
    their_slots = int.from_bytes(data, "little")
    try:
        theirs = mmap.mmap(fds[0], their_slots * nbytes)
    finally:
        os.close(fds[0])
    return _Link(peer, sock, _slots(ours, slots, nbytes), _slots(theirs, their_slots, nbytes))


def _slots(ring: mmap.mmap, n: int, nbytes: int) -> list[torch.Tensor]:
    return [torch.frombuffer(ring, dtype=torch.uint8, count=nbytes, offset=i * nbytes) for i in range(n)]


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise RuntimeError("a pipeline peer closed its connection while the shared-memory transport was set up")
        data += part
    return data
