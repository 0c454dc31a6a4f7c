"""ParallelGrid: this rank's coordinates in the (pp, dp, tp) mesh and the process groups along each axis.

Expert parallelism (EP) is carved out of DP, as in Megatron-LM and torchtitan: each run of `ep` consecutive DP ranks
(same pp, tp) is an ep group splitting the experts; the DP ranks holding the same experts form the expert-data-parallel
(edp) group, `dp // ep` of them. The global rank formula does not change."""

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.spec import resolve_dp

ProcessGroup = dist.ProcessGroup if dist.is_available() else object


def resolve_backend(backend: str) -> tuple[str, torch.device]:
    """'auto' -> nccl on cuda:LOCAL_RANK when CUDA exists, else gloo on cpu; explicit names pick their device."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        return backend, torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if backend == "gloo":
        return backend, torch.device("cpu")
    raise ValueError(f"parallel.backend={backend!r} is not one of 'auto', 'nccl', 'gloo'")


def local_device_problem(backend: str, local_workers: int) -> str | None:
    """Why `local_workers` processes on this host cannot each take a GPU (cuda:LOCAL_RANK) under `backend`, or None;
    judged before launch, where CUDA would say only 'invalid device ordinal' in every worker past the last GPU."""
    if resolve_backend(backend)[0] != "nccl":
        return None
    visible = torch.cuda.device_count()
    if local_workers <= visible:
        return None
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"{local_workers} local workers need a GPU each (parallel.backend={backend} puts worker i on cuda:i), but "
            f"this host sees {visible}" + ("" if shown is None else f" (CUDA_VISIBLE_DEVICES={shown!r})") +
            f"; start at most {visible} workers per node (torchrun --nproc-per-node, or a smaller parallel layout) "
            "or use parallel.backend=gloo")


@dataclass
class ParallelGrid:
    """This rank's place in the (pp, dp, tp) grid (TP fastest) and its process groups; None = no peers."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1  # DP ranks splitting each MoE layer's experts (divides dp)
    rank: int = 0
    world_size: int = 1
    pp_rank: int = 0
    dp_rank: int = 0
    tp_rank: int = 0
    ep_rank: int = 0  # dp_rank % ep: which share of the experts this rank holds
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "none"
    tp_group: ProcessGroup | None = field(default=None, repr=False)
    dp_group: ProcessGroup | None = field(default=None, repr=False)
    pp_group: ProcessGroup | None = field(default=None, repr=False)
    # tp x pp x ep of one expert-data-parallel replica (tp x pp of one dp replica at ep 1): the grad norm's group
    mp_group: ProcessGroup | None = field(default=None, repr=False)
    ep_group: ProcessGroup | None = field(default=None, repr=False)  # ep consecutive DP ranks: token dispatch
    edp_group: ProcessGroup | None = field(default=None, repr=False)  # DP ranks holding the same experts
    embed_group: ProcessGroup | None = field(default=None, repr=False)  # first + last stage: tied embeddings
    mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def single(cls, device: torch.device | str | None = None) -> "ParallelGrid":
        """One process, no process group: every size is 1 and every group is None."""
        if device is None:
            device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return cls(device=torch.device(device))

    @classmethod
    def build(cls, dp: int | None, tp: int, pp: int, *, backend: str, timeout_s: float, ep: int = 1,
              store: dist.Store | None = None) -> "ParallelGrid":
        """Join (or reuse) the default process group via env:// (or on `store`, with RANK from the environment) and
        carve the (pp, dp, tp) mesh out of it."""
        if dist.is_initialized():
            world_size = dist.get_world_size()
            backend = dist.get_backend() if backend == "auto" else backend
        else:
            world_size = int(os.environ.get("WORLD_SIZE", 1))
        dp = resolve_dp(world_size, dp, tp, pp)  # before any rendezvous: a bad layout never starts
        if dp % ep:
            raise ValueError(f"parallel.ep={ep} does not divide the data-parallel size {dp}")
        backend, device = resolve_backend(backend)
        if not dist.is_initialized():
            if world_size == 1 and "MASTER_ADDR" not in os.environ:
                return cls.single(device)  # a plain `python train.py`: nothing to rendezvous with
            if device.type == "cuda":
                torch.cuda.set_device(device)
            where = {"init_method": "env://"} if store is None else {
                "store": store, "rank": int(os.environ["RANK"]), "world_size": world_size}
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None, **where)
        mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        rank = dist.get_rank()
        pp_rank, dp_rank, tp_rank = (int(c) for c in mesh.get_coordinate())
        grid = cls(pp=pp, dp=dp, tp=tp, ep=ep, ep_rank=dp_rank % ep, rank=rank, world_size=world_size, pp_rank=pp_rank,
                   dp_rank=dp_rank, tp_rank=tp_rank, device=device, backend=backend, mesh=mesh,
                   tp_group=mesh.get_group("tp"), dp_group=mesh.get_group("dp"), pp_group=mesh.get_group("pp"))
        timeout = timedelta(seconds=timeout_s)
        edp = dp // ep
        grid.mp_group = grid._my_group([[grid.global_rank_of(p, e * ep + i, t) for p in range(pp) for i in range(ep)
                                         for t in range(tp)] for e in range(edp)], timeout)
        if ep > 1:
            grid.ep_group = grid._my_group([[grid.global_rank_of(p, e * ep + i, t) for i in range(ep)]
                                            for p in range(pp) for e in range(edp) for t in range(tp)], timeout)
            if edp > 1:
                grid.edp_group = grid._my_group([[grid.global_rank_of(p, e * ep + i, t) for e in range(edp)]
                                                 for p in range(pp) for i in range(ep) for t in range(tp)], timeout)
        else:
            grid.edp_group = grid.dp_group
        if pp > 1:
            grid.embed_group = grid._my_group([[grid.global_rank_of(0, d, t), grid.global_rank_of(pp - 1, d, t)]
                                               for d in range(dp) for t in range(tp)], timeout)
        return grid

    @property
    def edp(self) -> int:
        """DP ranks holding the same experts (their expert gradients are summed over these)."""
        return self.dp // self.ep

    def expert_mesh(self) -> DeviceMesh:
        """This rank's ep group as a mesh, (ep) or (ep, tp) under TP: stacked experts are sliced over ep along their
        expert dim and TP-split within a slice; checkpoints hand DCP such slices as DTensors on it."""
        if self.tp == 1:
            return DeviceMesh.from_group(self.ep_group, self.device.type, mesh_dim_names=("ep",))
        first = self.dp_rank - self.ep_rank
        ranks = [[self.global_rank_of(self.pp_rank, first + i, t) for t in range(self.tp)] for i in range(self.ep)]
        return DeviceMesh.from_group([self.ep_group, self.tp_group], self.device.type, mesh=torch.tensor(ranks),
                                     mesh_dim_names=("ep", "tp"))

    def _my_group(self, rank_lists: list[list[int]], timeout: timedelta) -> ProcessGroup:
        """Create every group in rank_lists (collective: all ranks, same order); return ours. Under NCCL one split of
        the world's communicator makes them all; new_group would split the whole world once per group."""
        if self.device.type == "cuda":
            return dist.split_group(split_ranks=rank_lists, timeout=timeout)
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks, timeout=timeout)
            if self.rank in ranks:
                mine = group
        return mine

    def global_rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """Global rank at grid coordinates (pp, dp, tp): tp + TP * (dp + DP * pp)."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)
