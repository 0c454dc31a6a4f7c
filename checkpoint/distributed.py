"""Training checkpoints with torch.distributed.checkpoint (DCP): this rank's share in, this rank's share out.

Keys are layout-free: a parameter under its global dense name, its optimizer state under
`optim/<name>/<field>`, RNG states under `rng/rank<r>/<device>`. A TP shard is handed to DCP as a
DTensor on the grid's `tp` submesh (`DTensor.from_local`, no communication, same storage), a slice of
stacked experts as one on the ep group's mesh (`ParallelGrid.expert_mesh`), so DCP
records its global shape and offsets and reshards on load into any other split, or into whole tensors
in one process. We chose DTensor over hand-written chunk metadata because DCP plans, deduplicates
(DP replicas) and reshards DTensors natively, with gloo and NCCL alike; without a process group
(one process, emulation at tp=1) every tensor is whole and DCP runs with `no_dist`.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor, Replicate, Shard

from checkpoint.checksums import checksum_problem, dcp_files, digests
from checkpoint.dense import CheckpointError
from checkpoint.disk import write_problem
from checkpoint.safe_reader import SafeReader
from checkpoint.sharded import (block_buffer, dcp_native, gathered, is_shard, local_part, scatter_into,
                                written_on_every_dp_rank)
from parallel.collectives import all_gather_cat, all_reduce_, broadcast_object
from parallel.grid import ParallelGrid
from parallel.step import Engine
from parallel.tensor_pass import join_blocks, local_block

OPTIM, RNG = "optim/", "rng/"
FRAMING = 2048  # bytes a DCP checkpoint adds per tensor, about (saved_bytes)


@dataclass
class TrainingState:
    """What one rank contributes to a training checkpoint, by reference (read at save, written at load)."""

    engine: Engine
    optimizer: torch.optim.Optimizer
    grid: ParallelGrid
    ties: dict[str, str]  # a tied weight -> the weight it equals (stored once, under the source's name)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def quiet_dcp():
    """DCP warns that it assumes one process whenever no process group exists; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _packed(param: nn.Parameter, grid: ParallelGrid) -> bool:
    """A TP shard made of several blocks of the dense tensor (packed parts: gate and up, q k v): no DTensor placement
    describes it, so it is gathered whole to save and sliced after loading (a collective over TP)."""
    return grid.tp > 1 and getattr(param, "tp_packed", 1) != 1  # a count of equal parts, or their sizes


def _split(param: nn.Parameter, grid: ParallelGrid) -> bool:
    """Whether a TP or EP pass split this parameter (its shards lie within the dense tensor at an offset)."""
    return _packed(param, grid) or (grid.tp > 1 and getattr(param, "tensor_parallel", False)) or (
        grid.ep > 1 and getattr(param, "expert_block", None) is not None)


def _global_view(tensor: torch.Tensor, param: nn.Parameter, grid: ParallelGrid) -> torch.Tensor:
    """`tensor` (shaped like this rank's `param`) as DCP should see it: a DTensor shard under TP or EP, else whole;
    FSDP's shard (zero=2/3) as it is where nothing else split it, else gathered first (`checkpoint.sharded`)."""
    if is_shard(tensor):
        if dcp_native(param, _split(param, grid)):
            return tensor
        tensor = gathered(tensor)
    if _packed(param, grid):
        blocks = all_gather_cat(tensor.unsqueeze(0), grid.tp_group, dim=0).unbind(0)
        return _sharded(join_blocks(list(blocks), param.partition_dim, param.tp_packed), param, grid, tp_split=False)
    return _sharded(tensor, param, grid, tp_split=grid.tp > 1 and getattr(param, "tensor_parallel", False))


def _sharded(tensor: torch.Tensor, param: nn.Parameter, grid: ParallelGrid, tp_split: bool) -> torch.Tensor:
    """`tensor` as a DTensor of its shards: along the TP dim over `tp` when `tp_split`, and for a slice of stacked
    experts along dim 0 over the ep group (the (ep, tp) mesh under TP, replicated over tp when whole over it);
    itself when it is neither."""
    expert = grid.ep > 1 and getattr(param, "expert_block", None) is not None
    if not expert:
        return DTensor.from_local(tensor, grid.mesh["tp"], [Shard(param.partition_dim)], run_check=False) \
            if tp_split else tensor
    mesh = grid.expert_mesh()
    over_tp = [Shard(param.partition_dim) if tp_split else Replicate()] if mesh.ndim == 2 else []
    return DTensor.from_local(tensor, mesh, [Shard(0), *over_tp], run_check=False)


def _load_view(tensor: torch.Tensor, param: nn.Parameter, grid: ParallelGrid,
               unpack: list[tuple[torch.Tensor, torch.Tensor, nn.Parameter | None]]) -> torch.Tensor:
    """What DCP loads into for `tensor`: its global view, or for a packed shard a whole buffer that `unpack`
    remembers to slice into `tensor` afterwards; an FSDP shard of a TP block reads the block, then its rows."""
    if is_shard(tensor):
        if dcp_native(param, _split(param, grid)):
            return tensor
        block = block_buffer(tensor)
        view = _load_view(block, param, grid, unpack)  # a packed block is sliced into `block` first, then scattered
        unpack.append((block, tensor, None))
        return view
    if not _packed(param, grid):
        return _global_view(tensor, param, grid)
    shape = list(tensor.shape)
    shape[param.partition_dim] *= grid.tp
    whole = torch.empty(shape, dtype=tensor.dtype)
    unpack.append((whole, tensor, param))
    return _sharded(whole, param, grid, tp_split=False)


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: ZeroRedundancyOptimizer keeps its DP partition in `.optim`."""
    return getattr(optimizer, "optim", optimizer)


def _owned(optimizer: torch.optim.Optimizer) -> set[int]:
    """ids of the parameters whose optimizer state this rank keeps (all of them without ZeRO)."""
    return {id(p) for group in _local_optimizer(optimizer).param_groups for p in group["params"]}


def _key(name: str, ties: dict[str, str]) -> str:
    """The stored name: a tied weight is its source, stored once."""
    return ties.get(name, name)


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def state_to_save(state: TrainingState) -> dict[str, torch.Tensor]:
    """The flat DCP state_dict of this rank: parameters, their optimizer state, this rank's RNG."""
    out: dict[str, torch.Tensor] = {}
    optim_state = _local_optimizer(state.optimizer).state
    for name, param in state.engine.named_parameters().items():
        key = _key(name, state.ties)
        if key != name:
            continue  # a tied head: its bitwise-equal embedding copy (first stage) is stored instead
        out[key] = _global_view(param.detach(), param, state.grid)
        for field, value in optim_state.get(param, {}).items():  # under ZeRO only the owning DP rank writes
            whole = value.shape == param.shape
            out[f"{OPTIM}{key}/{field}"] = _global_view(value, param, state.grid) if whole else value
    for device, rng in _rng_states().items():
        out[f"{RNG}rank{state.grid.rank}/{device}"] = rng
    return out


def check_finite(state: TrainingState, what: str) -> None:
    """Raise on every rank (they agree via an all-reduce) when any parameter holds NaN or Inf."""
    bad = [name for name, p in state.engine.named_parameters().items()
           if not bool(torch.isfinite(local_part(p)).all())]
    flag = torch.tensor([1.0 if bad else 0.0], device=state.grid.device)
    if _distributed():
        all_reduce_(flag, dist.group.WORLD, dist.ReduceOp.MAX)
    if flag.item() > 0:
        where = (bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")) if bad else \
            "a parameter on another rank"
        raise CheckpointError(f"{what}: {where} holds NaN or Inf; refusing non-finite weights")


def saved_bytes(tensors: dict[str, torch.Tensor], state: TrainingState) -> int:
    """The checkpoint's size, about, on every rank (an all-reduce): each stored tensor once, as DCP writes it.

    A shard (DTensor) counts on DP replica 0, a whole tensor on DP replica 0's first TP rank (DCP writes a replica
    once); optimizer state under ZeRO lives on its owning DP rank only; RNG states are per rank. DCP frames every
    tensor as a torch.save record (about 1.6 KB) and lists it in `.metadata` (about 0.2 KB): 2 KB each."""
    zero, grid, total = _local_optimizer(state.optimizer) is not state.optimizer, state.grid, 0
    for key, tensor in tensors.items():
        sharded = isinstance(tensor, DTensor)
        local = tensor.to_local() if sharded else tensor
        if key.startswith(RNG) or ((grid.dp_rank == 0 or written_on_every_dp_rank(tensor) or (
                zero and key.startswith(OPTIM))) and (
                sharded or grid.tp_rank == 0)):
            total += local.numel() * local.element_size() + FRAMING
    if _distributed():
        flag = torch.tensor([total], dtype=torch.float64, device=grid.device)
        total = int(all_reduce_(flag, dist.group.WORLD).item())
    return total


def agreed(problem: str | None) -> str | None:
    """The first rank's problem (by rank) on every rank, or None when no rank had one (an all-gather)."""
    if not _distributed():
        return problem
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, problem)
    return next((p for p in every if p), None)


def _shared(names: list[str], grid: ParallelGrid) -> list[str]:
    """This rank's share of `names` (every world-th), so the ranks hash a folder together."""
    return names[grid.rank::grid.world_size] if _distributed() else names


def save_state(path: Path, state: TrainingState, what: str,
               before_write: Callable[[int], str | None] | None = None) -> dict[str, str]:
    """Write this rank's share into the DCP folder `path` (a collective over every rank); return the sha256 of
    every shard DCP wrote, by name (the ranks hash them together).

    `before_write(bytes needed)` runs on rank 0 before anything is written (the folder's owner, its free space). A line
    it returns, and a failed write (a full or read-only disk: the folder and the space needed are named), end the
    save on every rank with the same CheckpointError starting with `what`; the partial folder is removed."""
    tensors = state_to_save(state)
    needed = saved_bytes(tensors, state)
    problem = before_write(needed) if before_write is not None and state.grid.rank == 0 else None
    if problem := broadcast_object(problem, dist.group.WORLD if _distributed() else None, src=0):
        raise CheckpointError(problem)
    failure = None
    try:
        writer = dcp.FileSystemWriter(str(path), thread_count=1)
        with quiet_dcp():
            dcp.save(tensors, storage_writer=writer, no_dist=not _distributed())
    except (Exception, CheckpointException) as error:  # noqa: BLE001  DCP wraps write failures (a BaseException)
        failure = write_problem(error, path.parent, needed, what) or f"{what}: {_last_line(error)}"
    _abandon_on(agreed(failure), path, state)
    names = broadcast_object(dcp_files(path) if state.grid.rank == 0 else None,
                             dist.group.WORLD if _distributed() else None, src=0)
    try:
        mine, failure = digests(path, _shared(names, state.grid)), None
    except OSError as error:
        mine, failure = {}, f"{what}: reading back {path} failed ({error.strerror or type(error).__name__})"
    _abandon_on(agreed(failure), path, state)
    if not _distributed():
        return mine
    every: list[dict[str, str]] = [{}] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name: value for share in every for name, value in share.items()}


def _abandon_on(failure: str | None, path: Path, state: TrainingState) -> None:
    """Raise `failure` (the same on every rank) once rank 0 removed the partial folder; nothing without one."""
    if failure:
        if state.grid.rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # every rank stopped writing: the previous checkpoint stays
        raise CheckpointError(failure)


def _last_line(error: BaseException) -> str:
    """The last line of `error`'s text (DCP's wraps every rank's traceback), cut to 200 characters."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(error).__name__


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata at `path`, read through the allow-list (`safe_reader`); one line when it is unreadable."""
    try:
        return SafeReader(str(path)).read_metadata()
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001  any unreadable metadata is one message
        raise CheckpointError(f"checkpoint {path}: unreadable metadata ({type(error).__name__}); the checkpoint "
                              "is corrupt or truncated: resume from another one") from None


def read_keys(path: Path) -> dict[str, torch.Size]:
    """Stored key -> global shape (tensors only), from the DCP metadata at `path`."""
    return {k: getattr(v, "size", None) for k, v in read_metadata(path).state_dict_metadata.items()}


def _targets(state: TrainingState, stored: dict[str, torch.Size], path: Path, unpack: list):
    """The DCP state_dict to load into, the optimizer states it fills, and tied copies to set afterwards."""
    named = state.engine.named_parameters()
    owned = _owned(state.optimizer)
    into: dict[str, torch.Tensor] = {}
    optim: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    copies: list[tuple[nn.Parameter, nn.Parameter]] = []
    for name, param in named.items():
        key = _key(name, state.ties)
        if key != name and key in named:
            copies.append((named[key], param))  # both tie copies live here (emulation): load one, copy
            continue
        view = _load_view(param.data, param, state.grid, unpack)
        if key not in stored:
            raise CheckpointError(f"checkpoint {path} has no {key}: it was written for another model; "
                                  "use the same model settings or checkpoint.resume=none")
        if tuple(stored[key]) != tuple(view.shape):
            raise CheckpointError(f"checkpoint {path}: {key} has shape {tuple(stored[key])}, the model expects "
                                  f"{tuple(view.shape)}; use the same model settings or checkpoint.resume=none")
        into[key] = view
        fields = {k.rsplit("/", 1)[1]: s for k, s in stored.items() if k.startswith(f"{OPTIM}{key}/")}
        optim[param] = {}
        for field, shape in (fields.items() if id(param) in owned else ()):
            local = torch.zeros_like(param.data) if tuple(shape) == tuple(view.shape) else torch.zeros(shape)
            optim[param][field] = local
            into[f"{OPTIM}{key}/{field}"] = _load_view(local, param, state.grid, unpack) \
                if local.shape == param.shape else local
    return into, optim, copies


def load_state(path: Path, state: TrainingState) -> None:
    """Load parameters, optimizer state and (where stored for this rank) RNG from `path`, in any layout."""
    share = (state.grid.rank, state.grid.world_size) if _distributed() else (0, 1)
    if problem := agreed(checksum_problem(path, share)):  # the ranks check the checksums together, before DCP reads
        raise CheckpointError(problem)
    stored = read_keys(path)
    unpack: list[tuple[torch.Tensor, torch.Tensor, nn.Parameter | None]] = []  # packed TP shards: whole -> this block
    into, optim, copies = _targets(state, stored, path, unpack)
    rng = {k: torch.empty(s, dtype=torch.uint8) for k, s in stored.items()
           if k.startswith(f"{RNG}rank{state.grid.rank}/")}
    try:
        with quiet_dcp():
            dcp.load({**into, **rng}, storage_reader=SafeReader(str(path)), no_dist=not _distributed())
    except (Exception, CheckpointException) as error:  # noqa: BLE001  DCP wraps read failures (a BaseException)
        detail = _last_line(error)
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({detail}); delete it or resume from "
                              "another checkpoint") from None
    for whole, local, param in unpack:
        if param is None:  # an FSDP shard: this rank's rows of the block read
            scatter_into(local, whole)
        else:
            local.copy_(local_block(whole, state.grid.tp_rank, state.grid.tp, param.partition_dim, param.tp_packed))
    optim_state = _local_optimizer(state.optimizer).state
    for param, fields in optim.items():
        if fields:
            optim_state[param] = fields
    for source, target in copies:
        target.data.copy_(source.data)
        if source in optim_state and id(target) in _owned(state.optimizer):
            optim_state[target] = {k: v.clone() for k, v in optim_state[source].items()}
    if f"{RNG}rank{state.grid.rank}/cpu" in rng:
        torch.set_rng_state(rng[f"{RNG}rank{state.grid.rank}/cpu"])
    if torch.cuda.is_available() and f"{RNG}rank{state.grid.rank}/cuda" in rng:
        torch.cuda.set_rng_state(rng[f"{RNG}rank{state.grid.rank}/cuda"])
    check_finite(state, f"checkpoint {path}")
