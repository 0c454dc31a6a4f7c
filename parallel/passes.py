"""The passes that make a model chunk from the dense decoder, in one order for every layout.

A pass is a callable `(chunk, site) -> chunk` bound to its own settings only. `chunk_passes` is the one ordered
list: prune, TP, EP, the caller's own passes (`EngineSpec.passes`: they see the layers TP and EP made), recompute,
compile, materialise, then the TP gradient sums (a hook on a meta tensor would not survive materialising). Under
FSDP (`sharded`: `EngineSpec.shard` on pipeline stages) the last two wait for the sharding pass
(`parallel.fsdp.shard_stages`): a meta chunk is sharded first, so each rank fills only its shards.
`build_chunk` runs a list for one site: the one-process engine's whole model and every pipeline stage alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

from parallel.compile import apply_compile, compile_mode
from parallel.expert import apply_expert_parallel
from parallel.materialize import is_meta, materialize_
from parallel.recompute import apply_recompute
from parallel.tensor_pass import shard_modules, sync_replicated_grads

if TYPE_CHECKING:  # names in annotations only
    from parallel.decoder import Decoder
    from parallel.grid import ParallelGrid
    from parallel.materialize import WeightSource
    from parallel.spec import EngineSpec


@dataclass(frozen=True)
class Site:
    """Where a chunk runs: its grid, the dense layers it keeps, and whether it is the first / last stage."""

    grid: ParallelGrid
    kept: range  # the ids of the dense layers it holds
    first: bool
    last: bool


class ChunkPass(Protocol):
    """One step of making a chunk: changes it in place, or returns a new one (pruning)."""

    def __call__(self, chunk: Decoder, site: Site) -> Decoder: ...


def prune(decoder: Decoder, site: Site) -> Decoder:
    """A copy of the dense decoder keeping the site's layers (and the embedding / head where it is first / last)."""
    return decoder.prune(site.kept, site.first, site.last)


def materialise(chunk: Decoder, site: Site, weights: WeightSource | None, deferred: bool = False) -> Decoder:
    """A meta chunk gets storage on the device, filled from `weights` (unless `deferred`: FSDP's pass fills its
    shards); a built one is moved there."""
    grid = site.grid
    if not is_meta(chunk.module):
        chunk.module.to(grid.device)
    elif weights is None:
        raise ValueError("a model built on the meta device needs a weight source (seeded init or checkpoint)")
    elif not deferred:
        materialize_(chunk, weights, grid.tp_rank, grid.tp, grid.device)
    return chunk


def _replicated_grad_sums(chunk: Decoder, site: Site) -> Decoder:
    """TP-replicated parameters that see part of the sharded activations sum their gradients over TP."""
    sync_replicated_grads(chunk, site.grid)
    return chunk


def chunk_passes(spec: EngineSpec, weights: WeightSource | None, sharded: bool = False) -> list[ChunkPass]:
    """The ordered passes of `spec`, materialising from `weights` (left to FSDP's pass when `sharded`)."""
    return [prune, lambda chunk, site: shard_modules(chunk, site.grid),
            lambda chunk, site: apply_expert_parallel(chunk, site.grid), *spec.passes,
            lambda chunk, site: apply_recompute(chunk, spec.recompute),
            lambda chunk, site: apply_compile(chunk, compile_mode(spec.compile, site.grid.device)),
            partial(materialise, weights=weights, deferred=sharded),
            *([_replicated_grad_sums] if not sharded else [])]


def build_chunk(decoder: Decoder, site: Site, passes: list[ChunkPass]) -> Decoder:
    """The chunk of `site` made from the dense decoder by `passes`, in order."""
    for chunk_pass in passes:
        decoder = chunk_pass(decoder, site)
    return decoder
