"""FSDP's sharded parameters (`parallel.zero=2/3`) in a training checkpoint: the same keys and global shapes as whole
parameters, so a checkpoint moves between zero levels, DP degrees and TP x PP layouts unchanged.

A shard DCP can describe (FSDP's split of a tensor no TP or EP pass has split) goes to DCP as the DTensor it is: each
rank writes and reads its own rows, and DCP reshards on load into any other layout. A shard of a TP block (its rows of
this rank's columns, or of a packed block) has no placement that describes it within the dense tensor, so it is
gathered over DP into the TP block, one tensor at a time, and takes the whole-parameter path; on load the block is read
and this rank's rows are copied into the shard.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def is_shard(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is FSDP's shard (a DTensor) rather than a whole tensor."""
    return isinstance(tensor, DTensor)


def dcp_native(param: nn.Parameter, split: bool) -> bool:
    """Whether DCP can take this parameter's shards as they are: no TP/EP split (`split`) lies under FSDP's."""
    return is_shard(param) and not split


def gathered(tensor: DTensor) -> torch.Tensor:
    """The whole (TP-local) tensor of a shard: an all-gather over its DP ranks."""
    return tensor.full_tensor()


def block_buffer(tensor: DTensor) -> torch.Tensor:
    """An empty whole tensor to read a shard's block into before `scatter_into`."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.to_local().device)


def scatter_into(shard: DTensor, whole: torch.Tensor) -> None:
    """Copy this rank's rows of `whole` into `shard` (no communication: every rank holds `whole`)."""
    mine = distribute_tensor(whole, shard.device_mesh, shard.placements, src_data_rank=None)
    shard.to_local().copy_(mine.to_local())


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: a shard's local rows, or the tensor itself."""
    return tensor.to_local() if is_shard(tensor) else tensor


def written_on_every_dp_rank(tensor: torch.Tensor) -> bool:
    """Whether DCP writes this tensor's parts on every DP rank (a shard split over the DP ranks)."""
    return is_shard(tensor) and any(name.startswith("dp") for name in tensor.device_mesh.mesh_dim_names or ())
