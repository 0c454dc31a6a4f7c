"""The shared-memory transport: the pick of `parallel.transport`, the same numbers as gloo P2P (full rings
included), and a peer that is gone or silent named at once or at the timeout."""

import dataclasses
import socket
import threading
import time

import pytest
import torch

from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from parallel.pipeline import shm_transport
from parallel.pipeline.actions import Action, Kind
from parallel.pipeline.shm_transport import ShmTransport
from parallel.pipeline.transport import Boundary, Message, P2PTransport, TransportTimeout
from tests.spawn import run_workers
from tests.test_runtime import batches, dense_grads, layout_cfg, tiny

BOUNDARY = Boundary((2, 16, 32), torch.float32)  # tiny()'s hidden size at micro_batch_size 2, seq_len 16
BOUNDARY_BYTES = 2 * 16 * 32 * 4


def _engine_worker(rank: int, world_size: int, schedule: str, max_slots: int, ring_bytes: int) -> dict:
    """One step under each transport; gradients by name and the transports' types."""
    # This process only: a small ring makes senders wait for acks.
    shm_transport.MAX_SLOTS, shm_transport.RING_BYTES = max_slots, ring_bytes
    grid = ParallelGrid.build(1, 1, 2, backend="gloo", timeout_s=60)
    out: dict = {"grads": {}, "types": {}, "slots": {}}
    for transport in ("auto", "p2p"):
        spec = dataclasses.replace(layout_cfg(schedule, 2, 4), emulate=False, transport=transport)
        engine = ParallelEngine(spec, tiny(), grid)
        engine.step(batches(4))
        out["types"][transport] = type(engine.transport).__name__
        out["grads"][transport] = {n: p.grad.clone() for n, p in engine.named_parameters().items()}
        if isinstance(engine.transport, ShmTransport):
            out["slots"] = {peer: len(link.tx) for peer, link in engine.transport.links.items()}
    return out


@pytest.mark.parametrize("schedule, max_slots, ring_bytes, slots", [
    ("1f1b", 16, 256 << 20, 4),  # a ring holds a step's sends to the peer
    ("1f1b", 16, 3 * BOUNDARY_BYTES - 1, 2),  # or what fits in RING_BYTES
    ("gpipe", 1, 256 << 20, 1)])  # gpipe: rank 0 sends four activations in a row, each waiting for an ack
def test_shm_is_the_cpu_default_and_gives_gloos_gradients_bit_for_bit(schedule, max_slots, ring_bytes, slots):
    results = run_workers(_engine_worker, 2, schedule, max_slots, ring_bytes, timeout=120)
    reference = dense_grads(tiny(), batches(4))
    for rank, r in enumerate(results):
        assert r["types"] == {"auto": "ShmTransport", "p2p": "P2PTransport"}, r["types"]
        assert r["slots"] == {1 - rank: slots}, r["slots"]
        for name, grad in r["grads"]["auto"].items():
            assert torch.equal(grad, r["grads"]["p2p"][name]), (rank, name)
            expected = reference["model.embed_tokens.weight" if name == "lm_head.weight" else name]
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7, msg=name)


def _message(kind: Kind, microbatch: int, stage: int, peer: int, tensor: torch.Tensor | None = None) -> Message:
    return Message(Action(kind, microbatch, stage), peer, tensor)


def _transport(rank: int, timeout_s: float) -> ShmTransport:
    """A connected pair; connecting gets 60 s whatever the wait under test is bounded by (a busy machine)."""
    ParallelGrid.build(1, 1, 2, backend="gloo", timeout_s=60)
    transport = shm_transport.shm_transport(rank, BOUNDARY, 60, {1 - rank: 2}, required=True)
    assert transport is not None
    transport.timeout_s = timeout_s  # the wait under test
    return transport


def _gone_worker(rank: int, world_size: int) -> dict:
    """Rank 1 closes its transport, as its exit would; rank 0 waits for an activation from it."""
    transport = _transport(rank, timeout_s=60)
    if rank == 1:
        transport.close()
        return {}
    (pending,) = transport.post([_message(Kind.RECV_F, 0, 1, peer=1)])
    start = time.monotonic()
    try:
        pending.wait()
    except TransportTimeout as error:
        return {"error": str(error), "waited_s": time.monotonic() - start}
    return {"error": None}


def test_a_peer_that_is_gone_fails_the_wait_at_once_naming_it():
    r = run_workers(_gone_worker, 2, timeout=60)[0]
    assert r["error"] == ("rank 0: receiving activation from rank 1 for micro-batch 0 (stage 1, RECV_F0@s1) failed: "
                          "rank 1 closed its connection (it exited or failed; its own error says why)"), r
    assert r["waited_s"] < 10, r  # the close, not parallel.timeout_s (60 s)


def _silent_worker(rank: int, world_size: int) -> str | None:
    """Rank 0 waits 1 s for a gradient rank 1 never sends; rank 1 waits for the end."""
    transport = _transport(rank, timeout_s=1)
    error = None
    if rank == 0:
        (pending,) = transport.post([_message(Kind.RECV_B, 2, 0, peer=1)])
        try:
            pending.wait()
        except TransportTimeout as caught:
            error = str(caught)
    torch.distributed.barrier()
    return error


def test_a_message_that_never_comes_times_out_naming_the_transfer():
    error = run_workers(_silent_worker, 2, timeout=60)[0]
    assert error == ("rank 0: receiving gradient from rank 1 for micro-batch 2 (stage 0, RECV_B2@s0) did not "
                     "complete within 1s (parallel.timeout_s)")


def _hosts_worker(rank: int, world_size: int) -> tuple[str | None, bool]:
    """Ranks that report different hosts: auto falls back (None), shm refuses naming them."""
    ParallelGrid.build(1, 1, 2, backend="gloo", timeout_s=60)
    with pytest.MonkeyPatch.context() as mp:  # the pooled process serves later tests: put the host back after
        mp.setattr(shm_transport.socket, "gethostname", lambda: f"node{rank}")
        mp.setattr(shm_transport, "_machine", lambda: (f"boot-id-of-node{rank}", 4026531840))
        fallback = shm_transport.shm_transport(rank, BOUNDARY, 5, {1 - rank: 1}, required=False)
        try:
            shm_transport.shm_transport(rank, BOUNDARY, 5, {1 - rank: 1}, required=True)
        except ValueError as error:
            return str(error), fallback is None
    return None, fallback is None


def test_ranks_on_several_hosts_fall_back_to_p2p_and_shm_refuses_naming_the_hosts():
    for error, fell_back in run_workers(_hosts_worker, 2, timeout=60):
        assert fell_back
        assert error == ("parallel.transport=shm needs every rank on one host (and network namespace), but they run "
                         "on ['node0', 'node1']; use parallel.transport=auto or p2p")


def test_a_gpu_run_takes_p2p_and_shm_refuses_it():
    from parallel.pipeline.connect import choose_transport
    from parallel.pipeline.lowered import lower_pipeline

    grid = ParallelGrid(pp=2, world_size=2, device=torch.device("cuda", 0))  # refused before any collective
    spec = dataclasses.replace(layout_cfg("1f1b", 2, 4), emulate=False, transport="shm")
    with pytest.raises(ValueError, match="parallel.transport=shm carries CPU tensors on Linux; this run computes "
                                         "on cuda: use parallel.transport=auto or p2p"):
        choose_transport(spec, lower_pipeline(spec.pipeline, 4), grid, 32)
    auto = dataclasses.replace(spec, transport="auto")
    transport, _ = choose_transport(auto, lower_pipeline(spec.pipeline, 4), grid, 32)
    assert isinstance(transport, P2PTransport)  # NCCL's; no collective asked of a GPU run


def _pair(slots: int = 2) -> tuple[ShmTransport, ShmTransport]:
    """Ranks 0 and 1 of one process, linked as the set-up links them (over a socket pair)."""
    ends = socket.socketpair()
    nbytes = shm_transport.boundary_bytes(BOUNDARY)
    links: dict = {}
    other = threading.Thread(target=lambda: links.__setitem__(1, shm_transport._open_link(ends[1], 0, slots, nbytes)))
    other.start()
    links[0] = shm_transport._open_link(ends[0], 1, slots, nbytes)
    other.join()
    return ShmTransport(0, BOUNDARY, 5, {1: links[0]}), ShmTransport(1, BOUNDARY, 5, {0: links[1]})


def test_what_a_peer_sent_before_it_exited_is_received_even_when_the_ack_finds_it_gone():
    rank0, rank1 = _pair()
    first, second = torch.full(BOUNDARY.shape, 1.0), torch.full(BOUNDARY.shape, 2.0)
    rank1.post([_message(Kind.SEND_F, 0, 0, peer=0, tensor=first)])
    receives = rank0.post([_message(Kind.RECV_F, 0, 1, peer=1), _message(Kind.RECV_F, 1, 1, peer=1)])
    link = rank0.links[1]
    sock = link.sock

    class ExitsBeforeTheAck:
        """Rank 0's socket, where rank 1 sends once more and exits between rank 0's read and its ack."""

        def fileno(self) -> int:
            return sock.fileno()

        def recv(self, *args):
            return sock.recv(*args)

        def sendall(self, data: bytes) -> None:
            rank1.post([_message(Kind.SEND_F, 1, 0, peer=0, tensor=second)])
            rank1.close()
            raise BrokenPipeError(32, "Broken pipe")

    link.sock = ExitsBeforeTheAck()
    for pending in receives:
        pending.wait()
    assert torch.equal(receives[0].tensor, first) and torch.equal(receives[1].tensor, second)
    (late,) = rank0.post([_message(Kind.RECV_F, 2, 1, peer=1)])
    with pytest.raises(TransportTimeout, match="rank 1 closed its connection"):
        late.wait()


def test_a_process_claiming_a_rank_it_is_not_is_turned_away():
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"\0sluice-test-{time.monotonic_ns()}"
    listener.bind(address)
    listener.listen(2)
    endpoints = [shm_transport._Endpoint("here", ("boot", 1), 1, "") for _ in range(2)]  # rank 1 runs as pid 1
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(address)
    stranger.sendall((1).to_bytes(4, "little"))  # "I am rank 1", from this test's pid
    with pytest.raises(TransportTimeout, match=r"^rank 0: rank\(s\) \[1\] did not connect to the shared-memory "
                                               r"transport within 1s \(parallel.timeout_s\)$"):
        shm_transport._connect(0, {1: 1}, 64, 1.0, listener, endpoints)
    stranger.close()
    listener.close()


def test_a_send_waiting_in_post_for_a_full_ring_is_what_the_hang_watch_reports():
    from training.reliability.hang import Watch, WatchedTransport

    watch, seen = Watch(0), []

    class FullRing:
        def post(self, messages: list[Message]) -> list:
            seen.append((str(watch.state.what), watch.state.waits_for))  # what a dump taken now would say
            return []

    WatchedTransport(FullRing(), watch).post([_message(Kind.SEND_F, 3, 0, peer=1, tensor=torch.ones(1))])
    assert seen == [("waiting: rank 0: sending activation to rank 1 for micro-batch 3 (stage 0, SEND_F3@s0)", [1])]


def test_shm_on_a_gpu_run_is_refused_before_launch(monkeypatch, tmp_path):
    from tests.equivalence import compose_run_config
    from training.config.validate import parallel_problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine says
    cfg = compose_run_config(["parallel.pp=2", "parallel.transport=shm"], tmp_path)
    assert parallel_problem(cfg) == ("parallel.transport=shm carries CPU tensors, but parallel.backend=auto computes "
                                     "on CUDA; use parallel.transport=auto (NCCL's P2P on GPUs) or parallel.backend=gloo")
    assert parallel_problem(compose_run_config(["parallel.pp=2", "parallel.transport=shm", "parallel.backend=gloo"],
                                               tmp_path)) is None  # gloo computes on the CPU: shm is fine
