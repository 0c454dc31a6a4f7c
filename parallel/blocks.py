"""A TP rank's block of a dense tensor and back, for plain and packed shards.

A packed tensor lies in parts side by side along the sharded dim (Phi-3's `qkv_proj` rows [q | k | v], unequal under
GQA; a fused `gate_up_proj` [gate | up]): each rank holds its block of every part, in part order, so that its local
output is [q_r | k_r | v_r] and the module's own split of it still works. `Parts` says how the parts lie: a count of
equal parts, or each part's dense size.
"""

from __future__ import annotations

import torch

Parts = int | tuple[int, ...]  # equal parts (1: not packed), or each part's dense size along the sharded dim


def part_sizes(total: int, packed: Parts) -> list[int]:
    """Each part's dense size along the sharded dim of a `total`-long tensor packed as `packed` says."""
    sizes = [total // packed] * packed if isinstance(packed, int) else list(packed)
    if sum(sizes) != total or (isinstance(packed, int) and total % packed):
        raise ValueError(f"packed parts {packed} do not tile a dim of size {total}")
    return sizes


def local_block(dense: torch.Tensor, tp_rank: int, tp: int, dim: int, packed: Parts = 1) -> torch.Tensor:
    """This TP rank's block of `dense` along `dim` (each packed part sliced alike, then concatenated)."""
    sizes = part_sizes(dense.shape[dim], packed)
    if any(size % tp for size in sizes):
        raise ValueError(f"tp={tp} does not divide the packed parts {sizes} of a dim of size {dense.shape[dim]}")
    return torch.cat([part.chunk(tp, dim=dim)[tp_rank] for part in dense.split(sizes, dim=dim)], dim=dim)


def join_blocks(blocks: list[torch.Tensor], dim: int, packed: Parts = 1) -> torch.Tensor:
    """The dense tensor from every TP rank's block, in rank order (the inverse of `local_block`)."""
    tp = len(blocks)
    local = [size // tp for size in part_sizes(blocks[0].shape[dim] * tp, packed)]
    pieces = [block.split(local, dim=dim) for block in blocks]
    return torch.cat([torch.cat([p[i] for p in pieces], dim=dim) for i in range(len(local))], dim=dim)
