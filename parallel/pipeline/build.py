"""This rank's stages of a pipeline: each stage's chunk made from the dense decoder by the chunk passes, tied pairs on
one rank re-tied, each wrapped in a Stage."""

from __future__ import annotations

from collections.abc import Callable

from parallel.decoder import Decoder, set_parameter
from parallel.grid import ParallelGrid
from parallel.passes import ChunkPass, Site, build_chunk

from .actions import Kind
from .partition import rank_stages
from .prepare import LoweredPipeline
from .stage import Stage

StagesByRank = dict[int, dict[int, Stage]]  # pipeline rank -> global stage index -> Stage
MakeStage = Callable[[Decoder, int, bool], Stage]  # (chunk, global stage index, backward split into I + W) -> Stage


def build_stages(pipeline: LoweredPipeline, decoder: Decoder, grid: ParallelGrid, ranks: list[int],
                 passes: list[ChunkPass], make_stage: MakeStage) -> StagesByRank:
    """The Stages of the given pipeline ranks (one rank, or every rank under emulation)."""
    stages: StagesByRank = {}
    for rank in ranks:
        split = {a.stage for a in pipeline.lowered[rank] if a.kind is Kind.I}  # stages whose backward is I + W
        chunks = rank_chunks(pipeline, decoder, grid, rank, passes)
        stages[rank] = {s: make_stage(chunk, s, s in split) for s, chunk in chunks.items()}
    return stages


def rank_chunks(pipeline: LoweredPipeline, decoder: Decoder, grid: ParallelGrid, rank: int,
                passes: list[ChunkPass]) -> dict[int, Decoder]:
    """One pipeline rank's chunks by global stage index, each made by `passes`; V placement puts the first and last
    stage on one rank, whose tied weights become one Parameter again."""
    spec, last = pipeline.spec, pipeline.n_stages - 1
    chunks = {s: build_chunk(decoder, Site(grid, pipeline.partition[s], s == 0, s == last), passes)
              for s in rank_stages(rank, spec.pp, spec.vpp, pipeline.placement)}
    if last > 0 and {0, last} <= chunks.keys():
        for tied, source in chunks[0].plan.ties.items():
            set_parameter(chunks[last].module, tied, chunks[0].parameter(source))
    return chunks
