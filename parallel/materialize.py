"""Materialising stages built on the meta device: only this rank's parameters ever get memory.

A stage is pruned and TP-sharded while its parameters are still meta tensors; then each parameter is filled
from a `WeightSource`, which yields the *dense* tensor of one global name at a time (a seeded initialiser or a
lazily read checkpoint), sliced here to this rank's TP block. So no rank holds the whole model, and a given
seed gives the same dense weights in every layout.

Under FSDP (`parallel.zero=2/3`) a stage is sharded while still meta (`parallel.fsdp`), and a sharded parameter
gets only this rank's rows of its TP block: a rank holds one dense tensor at a time, never its whole stage.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from parallel.decoder import ContractError, Decoder
from parallel.tensor_pass import local_block

# (dense name, dense shape) -> a dense tensor the caller owns: a fresh one per call, never shared with another
# name (two Parameters on one storage would be updated twice per step).
WeightSource = Callable[[str, tuple[int, ...]], torch.Tensor]


def seeded_init(decoder: Decoder, seed: int) -> WeightSource:
    """The family's initialisation (`FamilyAdapter.init_tensor`), each tensor from its own generator seeded by
    (seed, global name): identical whatever subset of the model a rank builds."""
    ties, adapter = decoder.plan.ties, decoder.adapter

    def init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        name = ties.get(name, name)  # a tied copy on another stage starts equal to its source
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return adapter.init_tensor(name, shape, generator)

    return init


def dense_shape(param: nn.Parameter, tp: int) -> tuple[int, ...]:
    """The shape of the dense tensor a (possibly TP-sharded, possibly EP-sliced) parameter is a block of."""
    shape = list(param.shape)
    if getattr(param, "tensor_parallel", False):
        shape[param.partition_dim] *= tp
    if (block := getattr(param, "expert_block", None)) is not None:
        shape[0] *= block[1]
    return tuple(shape)


def local_share(dense: torch.Tensor, param: nn.Parameter, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's block of the dense tensor: its slice of stacked experts (dim 0, `expert_block`), then its TP
    block; the dense tensor itself when the parameter is whole."""
    if (block := getattr(param, "expert_block", None)) is not None:
        dense = local_block(dense, block[0], block[1], 0)
    if getattr(param, "tensor_parallel", False):
        dense = local_block(dense, tp_rank, tp, param.partition_dim, getattr(param, "tp_packed", 1))
    return dense


def materialize_(decoder: Decoder, source: WeightSource, tp_rank: int, tp: int, device: torch.device) -> None:
    """Give the meta chunk storage on `device`, each parameter (once) filled from `source`, TP-sliced (and, for
    FSDP's sharded parameters, sliced again to this rank's shard).

    Each Parameter keeps its identity (a tie stays one object) and its attributes (the TP marks): the
    storage is swapped in, not a new Parameter made, as `Module.to_empty` would."""
    module = decoder.module
    for name, param in module.named_parameters():  # a Parameter shared by two modules is listed once
        if not param.is_meta:
            continue  # a pass made it with its value (no weight source holds it)
        if param._backward_hooks:
            raise RuntimeError(f"{name}: gradient hooks on a meta tensor do not survive materialising; "
                               "register them afterwards")
        dense = source(name, dense_shape(param, tp))
        local = local_share(dense, param, tp_rank, tp)
        if isinstance(param, DTensor):  # FSDP's shard: no collective (every rank read the same dense tensor)
            local = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
        # A block is copied: as a view it would pin the whole dense tensor.
        fresh = nn.Parameter(local.to(device=device, dtype=param.dtype, copy=local is not dense).contiguous(),
                             param.requires_grad)
        torch.utils.swap_tensors(param, fresh)
        param.__dict__.update(fresh.__dict__)  # swap_tensors swapped the attributes too: take them back
    unset = []
    for owner_name, owner in module.named_modules():
        for key, buffer in owner._buffers.items():
            if buffer is not None and buffer.is_meta:  # non-persistent tables and scales, computed below
                owner._buffers[key] = fresh = _unset_buffer(buffer, device)
                unset.append((f"{owner_name}.{key}".lstrip("."), owner, key, fresh, fresh._version))
    decoder.adapter.init_buffers(module)  # computed, never stored: no weight source holds them
    for name, owner, key, fresh, version in unset:
        buffer = owner._buffers.get(key)
        if buffer is None or buffer.is_meta or _still_unset(buffer, fresh, version):
            raise ContractError(f"{name}: a buffer that {type(decoder.adapter).__name__}.init_buffers leaves unset "
                                "after materialising from the meta device; compute it there (as the family's "
                                "_init_weights does)")


def _unset_buffer(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Storage for a meta buffer that reads as unset: NaN where the dtype has it (so a forgotten one poisons the
    loss rather than passing for a value), zeros otherwise (checked by its version counter instead)."""
    if buffer.is_floating_point() or buffer.is_complex():
        return torch.full_like(buffer, float("nan"), device=device)
    return torch.zeros_like(buffer, device=device)


def _still_unset(buffer: torch.Tensor, fresh: torch.Tensor, version: int) -> bool:
    """True when the adapter left a buffer as `_unset_buffer` made it (NaN anywhere, or never written)."""
    if buffer.is_floating_point() or buffer.is_complex():
        return bool(torch.isnan(buffer).any())
    return buffer is fresh and buffer._version == version


def is_meta(module: nn.Module) -> bool:
    """True when the module's parameters have no storage yet."""
    return any(p.is_meta for p in module.parameters())
