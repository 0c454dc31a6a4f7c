"""Building this rank's stages from a pipeline: prune the dense decoder per stage, apply TP, EP, LoRA, recompute and
compile, re-tie, wrap in Stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.decoder import Decoder, set_parameter
from parallel.expert import apply_expert_parallel
from parallel.grid import ParallelGrid
from parallel.lora import apply_lora, with_adapters
from parallel.spec import LoraSpec
from parallel.materialize import WeightSource, is_meta, materialize_
from parallel.compile import apply_compile
from parallel.recompute import apply_recompute
from parallel.step import Objective, TokenLoss
from parallel.tensor_pass import shard_modules, sync_replicated_grads

from .actions import Kind
from .partition import rank_stages
from .prepare import LoweredPipeline
from .stage import Stage

StagesByRank = dict[int, dict[int, Stage]]  # pipeline rank -> global stage index -> Stage


@dataclass(frozen=True)
class StageBuild:
    """How each stage module is made: compute dtype, loss, recompute mode, where weights come from, compiled or not,
    LoRA adapters or not."""

    dtype: torch.dtype
    token_loss: TokenLoss
    recompute: str  # none | full | selective
    weights: WeightSource | None = None  # required when the model is on the meta device
    compile: bool = False  # torch.compile each decoder layer
    lora: LoraSpec = LoraSpec()  # rank 0: no adapters, every weight trained
    objective: Objective | None = None  # what the last stage computes from the logits (None: no loss to compute)


def build_stages(pipeline: LoweredPipeline, decoder: Decoder, grid: ParallelGrid, ranks: list[int],
                 how: StageBuild) -> StagesByRank:
    """The Stages of the given pipeline ranks (one rank, or every rank under emulation)."""
    return {r: _rank_stages(pipeline, decoder, grid, r, how) for r in ranks}


def _rank_stages(pipeline: LoweredPipeline, decoder: Decoder, grid: ParallelGrid, rank: int,
                 how: StageBuild) -> dict[int, Stage]:
    """One pipeline rank's chunks: pruned copies of the dense decoder, TP-sharded, their experts EP-split, on the
    compute device."""
    spec, last = pipeline.spec, pipeline.n_stages - 1
    chunks = {s: decoder.prune(pipeline.partition[s], s == 0, s == last)
              for s in rank_stages(rank, spec.pp, spec.vpp, pipeline.placement)}
    weights = with_adapters(how.weights, how.lora)
    for chunk in chunks.values():
        shard_modules(chunk, grid)
        apply_expert_parallel(chunk, grid)
        apply_lora(chunk, how.lora, grid)
        apply_recompute(chunk, how.recompute)
        apply_compile(chunk, how.compile)
        place_(chunk, weights, grid)
        sync_replicated_grads(chunk, grid)
    tie_within_rank(chunks, last)
    split = {a.stage for a in pipeline.lowered[rank] if a.kind is Kind.I}  # stages whose backward is I + W
    return {s: Stage(chunk, s, pipeline.n_stages, grid.device, how.dtype, how.token_loss, s in split, how.objective)
            for s, chunk in chunks.items()}


def place_(decoder: Decoder, weights: WeightSource | None, grid: ParallelGrid) -> None:
    """A meta chunk is materialised on the device from `weights`; a built one is moved there."""
    if is_meta(decoder.module):
        if weights is None:
            raise ValueError("a model built on the meta device needs a weight source (seeded init or checkpoint)")
        materialize_(decoder, weights, grid.tp_rank, grid.tp, grid.device)
    else:
        decoder.module.to(grid.device)


def tie_within_rank(chunks: dict[int, Decoder], last: int) -> None:
    """V placement puts the first and last stage on one rank: their tied weights become one Parameter again."""
    if last > 0 and {0, last} <= chunks.keys():
        for tied, source in chunks[0].plan.ties.items():
            set_parameter(chunks[last].module, tied, chunks[0].parameter(source))
