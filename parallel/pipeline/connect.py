"""How this rank's stages reach their peers: the transport (in-process channels, shared memory or torch.distributed
P2P), the global rank at the other end of each send and receive, and the action lists as the runtime executes them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from parallel.grid import ParallelGrid
from parallel.spec import EngineSpec

from .actions import Action, Lists, comm_peer
from .lowered import LoweredPipeline
from .release import send_releases
from .runtime import Program, make_program
from .shm_transport import send_counts, shm_available, shm_transport
from .transport import Boundary, LocalTransport, P2PTransport, Transport


def choose_transport(spec: EngineSpec, pipeline: LoweredPipeline, grid: ParallelGrid,
                     hidden_size: int) -> tuple[Transport | LocalTransport, Callable[[Action], int]]:
    """The transport and the peer-rank function: in-process channels under emulation, else shared memory when
    every rank is on this host and computes on the CPU (`parallel.transport=auto`), else torch.distributed P2P."""
    # The residual stream stays fp32 under bf16 autocast (fp32 embedding + bf16 branches), so is the boundary.
    boundary = Boundary((spec.micro_batch_size, spec.seq_len, hidden_size), torch.float32)
    n_stages, placement, pp = pipeline.n_stages, pipeline.placement, pipeline.spec.pp
    if spec.emulate:
        return LocalTransport(boundary), functools.partial(comm_peer, n_stages=n_stages, placement=placement, pp=pp)

    def peer_of(action: Action) -> int:
        return grid.global_rank_of(comm_peer(action, n_stages, placement, pp), grid.dp_rank, grid.tp_rank)

    if spec.transport != "p2p":
        usable = grid.device.type == "cpu" and shm_available()
        if spec.transport == "shm" and not usable:
            raise ValueError(f"parallel.transport=shm carries CPU tensors on Linux; this run computes on "
                             f"{grid.device.type}: use parallel.transport=auto or p2p")
        if usable:  # the same answer on every rank: all of them take part in the collective below
            slots = send_counts(pipeline.lowered[grid.pp_rank], peer_of)
            shm = shm_transport(grid.rank, boundary, spec.timeout_s, slots, required=spec.transport == "shm")
            if shm is not None:
                return shm, peer_of
    return P2PTransport(grid.rank, boundary, grid.device, spec.timeout_s), peer_of


def programs_of(lists: Lists, ranks: Iterable[int], pipeline: LoweredPipeline, transport: Transport | LocalTransport,
                peer_of: Callable[[Action], int]) -> dict[int, Program]:
    """`ranks`' lists (of every rank's `lists`) as the runtime loop executes them: peers resolved, receives placed,
    and which arrival proves which send done."""
    early = getattr(transport, "receives_early", False)
    n_stages, placement, pp = pipeline.n_stages, pipeline.placement, pipeline.spec.pp
    return {r: make_program(list(lists[r]), peer_of, early, send_releases(lists, r, n_stages, placement, pp))
            for r in ranks}
