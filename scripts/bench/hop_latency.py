"""Hop latency of a boundary tensor between two pipeline ranks: gloo P2P against shared memory.

Two ranks play ping-pong with one boundary tensor (1 x 128 x 64 fp32, as in the sleep benchmark) through
Sluice's transports. Each rank sleeps before it sends, as a stage computes before its send, so every hop pays
what a pipeline hop pays: a sender just woken and a receiver that was asleep. A hop is (rank 0's round trip from
its send to its receive - rank 1's measured sleep) / 2. The two transports take turns, one round trip each
(A B, then B A). Writes the "transport" section of results.json.

    python scripts/bench/hop_latency.py [--smoke] [--rounds N] [--results PATH]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_workers  # noqa: E402
from harness import bench_parser, in_turn, update_results  # noqa: E402

import torch  # noqa: E402

from parallel.grid import ParallelGrid  # noqa: E402
from parallel.pipeline.actions import Action, Kind  # noqa: E402
from parallel.pipeline.shm_transport import shm_transport  # noqa: E402
from parallel.pipeline.transport import Boundary, Message, P2PTransport  # noqa: E402

BOUNDARY = Boundary((1, 128, 64), torch.float32)
COMPUTE_S = 0.005  # the sleep before each send (a stage's compute)


def worker(rank: int, world: int, rounds: int) -> dict[str, list[float]]:
    """Both transports, alternated. Rank 0 returns each round trip from its send to its receive, rank 1 its
    sleep in between (measured: a sleep overshoots by more than a hop takes)."""
    grid = ParallelGrid.build(dp=1, tp=1, pp=2, backend="gloo", timeout_s=300)
    peer = 1 - rank
    transports = {"gloo": P2PTransport(rank, BOUNDARY, grid.device, 60),
                  "shm": shm_transport(rank, BOUNDARY, 60, {peer: 2}, required=True)}
    tensor = torch.ones(BOUNDARY.shape)
    spans: dict[str, list[float]] = {name: [] for name in transports}
    for i in range(rounds + 2):  # two warm-up rounds
        for name in in_turn(transports, i):
            transport = transports[name]
            torch.distributed.barrier()
            if rank == 0:
                time.sleep(COMPUTE_S)
                start = time.perf_counter()
                _send(transport, peer, tensor)
                _receive(transport, peer)
            else:
                _receive(transport, peer)
                start = time.perf_counter()
                time.sleep(COMPUTE_S)
                spans[name].append(time.perf_counter() - start)  # before the send: it is the hop's
                _send(transport, peer, tensor)
            if rank == 0:
                spans[name].append(time.perf_counter() - start)
    torch.distributed.barrier()  # the last acks are taken before either rank leaves
    return {name: times[2:] for name, times in spans.items()}


def _send(transport, peer: int, tensor: torch.Tensor) -> None:
    (pending,) = transport.post([Message(Action(Kind.SEND_F, 0, 0), peer, tensor)])
    pending.wait()


def _receive(transport, peer: int) -> None:
    (pending,) = transport.post([Message(Action(Kind.RECV_F, 0, 1), peer)])
    pending.wait()


def main(argv: list[str]) -> dict:
    parser = bench_parser(__doc__, "3 rounds: checks the script works", rounds=200)
    args = parser.parse_args(argv)
    rounds = 3 if args.smoke else args.rounds
    trips, sleeps = run_workers(worker, 2, rounds, timeout=600)
    section = {f"{name}_hop_us": 1e6 * statistics.median((t - s) / 2 for t, s in zip(trips[name], sleeps[name]))
               for name in trips}
    section |= {"shm_over_gloo": section["shm_hop_us"] / section["gloo_hop_us"], "rounds": rounds,
                "boundary": list(BOUNDARY.shape), "compute_s": COMPUTE_S}
    update_results("transport", section, args.results)
    print(f"one hop, median of {rounds}: gloo {section['gloo_hop_us']:.0f} us, shared memory "
          f"{section['shm_hop_us']:.0f} us (ratio {section['shm_over_gloo']:.2f})")
    return section


if __name__ == "__main__":
    main(sys.argv[1:])
