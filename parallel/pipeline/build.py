"""This rank's model pieces: each stage's chunk made from the dense decoder by the chunk passes (or the whole model as
one chunk), tied pairs on one rank re-tied, each stage's chunk wrapped in a Stage with the layout's token loss;
at zero=2/3 the stages sharded with FSDP."""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import TYPE_CHECKING

from parallel.decoder import Decoder, set_parameter
from parallel.fsdp import shard_stages
from parallel.passes import ChunkPass, Site, build_chunk, chunk_passes
from parallel.step import TokenLoss, dense_token_loss
from parallel.tensor import vocab_parallel_cross_entropy

from .actions import Kind
from .partition import rank_stages
from .stage import Stage

if TYPE_CHECKING:  # names in annotations only
    from parallel.grid import ParallelGrid
    from parallel.materialize import WeightSource
    from parallel.spec import EngineSpec

    from .lowered import LoweredPipeline

StagesByRank = dict[int, dict[int, Stage]]  # pipeline rank -> global stage index -> Stage


def choose_token_loss(grid: ParallelGrid, vocab_size: int) -> TokenLoss:
    """Dense cross-entropy, or the vocab-parallel one over TP-sharded logits."""
    if grid.tp == 1:
        return dense_token_loss
    return functools.partial(vocab_parallel_cross_entropy, group=grid.tp_group,
                             vocab_start=grid.tp_rank * (vocab_size // grid.tp))


def whole_model(spec: EngineSpec, decoder: Decoder, grid: ParallelGrid, weights: WeightSource | None) -> Decoder:
    """The whole model as one chunk, made by the same passes as a pipeline stage (the one-process engine's)."""
    whole = Site(grid, range(decoder.config.num_hidden_layers), first=True, last=True)
    return build_chunk(decoder, whole, chunk_passes(spec, weights))


def build_stages(spec: EngineSpec, pipeline: LoweredPipeline, decoder: Decoder, grid: ParallelGrid, ranks: list[int],
                 weights: WeightSource | None) -> StagesByRank:
    """The Stages of the given pipeline ranks (one rank, or every rank under emulation)."""
    passes = chunk_passes(spec, weights, sharded=spec.shard is not None)
    token_loss, stages = choose_token_loss(grid, decoder.config.vocab_size), {}
    for rank in ranks:
        split = {a.stage for a in pipeline.lowered[rank] if a.kind is Kind.I}  # stages whose backward is I + W
        stages[rank] = {s: Stage(chunk, s, pipeline.n_stages, grid.device, spec.dtype, token_loss, s in split,
                                 spec.objective)
                        for s, chunk in rank_chunks(pipeline, decoder, grid, rank, passes).items()}
    return stages


def shard_built(stages: dict[int, Stage], grid: ParallelGrid, spec: EngineSpec, weights: WeightSource | None) -> dict:
    """`parallel.zero=2/3`: the built stages sharded with FSDP over the DP ranks, after every chunk pass, then filled
    from `weights` shard by shard (the FSDP modules by stage; none at zero 0/1)."""
    if spec.shard is None:
        return {}
    return shard_stages(stages, grid, spec.shard, timedelta(seconds=spec.timeout_s), weights)


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
