"""The passes that make a model chunk from the dense decoder, in one order for every layout.

A pass is a callable `(chunk, site) -> chunk` that holds only its own settings. `chunk_passes` is the one ordered
list: prune, TP, EP, the caller's own passes (`EngineSpec.passes`: they see the layers TP and EP made), recompute,
compile, materialise, then the TP gradient sums (a hook on a meta tensor would not survive materialising).
`build_chunk` runs a list for one site: the one-process engine's whole model and every pipeline stage alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from parallel.compile import apply_compile
from parallel.decoder import Decoder
from parallel.expert import apply_expert_parallel
from parallel.grid import ParallelGrid
from parallel.materialize import WeightSource, is_meta, materialize_
from parallel.recompute import apply_recompute
from parallel.spec import EngineSpec
from parallel.tensor_pass import shard_modules, sync_replicated_grads


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


def tensor_parallel(chunk: Decoder, site: Site) -> Decoder:
    """The plan's modules and parameters replaced by this TP rank's shards (still on the meta device)."""
    return shard_modules(chunk, site.grid)


def expert_parallel(chunk: Decoder, site: Site) -> Decoder:
    """This ep rank's share of every planned experts module, tokens dispatched to it."""
    return apply_expert_parallel(chunk, site.grid)


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation of the decoder layers: none | full | selective."""

    mode: str

    def __call__(self, chunk: Decoder, site: Site) -> Decoder:
        return apply_recompute(chunk, self.mode)


@dataclass(frozen=True)
class Compile:
    """torch.compile each decoder layer (after every pass that changes what a layer computes)."""

    enabled: bool

    def __call__(self, chunk: Decoder, site: Site) -> Decoder:
        return apply_compile(chunk, self.enabled)


@dataclass(frozen=True)
class Materialise:
    """A meta chunk gets storage on the device, filled from `weights`; a built one is moved there."""

    weights: WeightSource | None  # required when the model is on the meta device

    def __call__(self, chunk: Decoder, site: Site) -> Decoder:
        grid = site.grid
        if not is_meta(chunk.module):
            chunk.module.to(grid.device)
        elif self.weights is None:
            raise ValueError("a model built on the meta device needs a weight source (seeded init or checkpoint)")
        else:
            materialize_(chunk, self.weights, grid.tp_rank, grid.tp, grid.device)
        return chunk


def replicated_grad_sums(chunk: Decoder, site: Site) -> Decoder:
    """TP-replicated parameters that see part of the sharded activations sum their gradients over TP."""
    sync_replicated_grads(chunk, site.grid)
    return chunk


def chunk_passes(spec: EngineSpec, weights: WeightSource | None) -> list[ChunkPass]:
    """The ordered passes of `spec`, materialising from `weights`."""
    return [prune, tensor_parallel, expert_parallel, *spec.passes, Recompute(spec.recompute), Compile(spec.compile),
            Materialise(weights), replicated_grad_sums]


def build_chunk(decoder: Decoder, site: Site, passes: list[ChunkPass]) -> Decoder:
    """The chunk of `site` made from the dense decoder by `passes`, in order."""
    for chunk_pass in passes:
        decoder = chunk_pass(decoder, site)
    return decoder
