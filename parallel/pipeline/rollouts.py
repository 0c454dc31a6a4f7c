"""A DP replica's generation in its training layout: the generation schedule's lists run by the same runtime loop
over the stages' own chunks, round after round, until every sequence stopped or `max_new_tokens`.

A round is one verified list of `ticks` ticks over the micro-batches that still have a row before EOS. Between
rounds the last pipeline rank tells the others the round's last tokens (the next round's first input) and which rows
emitted EOS; a micro-batch whose rows all did drops out. Under expert parallelism the DP replicas dispatch tokens to
each other inside every MoE layer, so they run the same forwards: every micro-batch runs until no replica has a row
left. A round's fill and drain cost pp - 1 ticks each; longer rounds amortise them, shorter ones drop finished
micro-batches sooner.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from parallel.collectives import all_gather_cat, all_reduce_
from parallel.generation import Rollout, Sampling, Sequences, check_prompts, completions, generation_mode, rollout
from parallel.step import MicroBatch

from .generation import generation_lists, generation_peer, token_mate
from .partition import stage_to_rank
from .generation_stage import GenerationBoundary, GenerationStage, Round
from .runtime import StepScales, execute, execute_emulated, make_program
from .transport import LocalTransport, P2PTransport

if TYPE_CHECKING:
    from parallel.grid import ParallelGrid
    from parallel.spec import EngineSpec

    from .lowered import LoweredPipeline
    from .stage import Stage


class LayoutEngine(Protocol):
    """What generation reads of a rank's step engine (`ParallelEngine`): its layout and its stages."""

    spec: EngineSpec
    grid: ParallelGrid
    pipeline: LoweredPipeline
    emulated: bool
    stages_of: dict[int, dict[int, Stage]]
    stages: dict[int, Stage]

TICKS_PER_ROUND = 16  # ticks between two checks for EOS: 2(pp - 1) ticks of bubble per 16 * M forwards


def generate_in_layout(engine: LayoutEngine, prompts: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
                       first_row: int | None = None, ticks_per_round: int = TICKS_PER_ROUND) -> Rollout:
    """This replica's completions; rows are numbered (for sampling) from `first_row`, by default as if the replicas'
    prompts were stacked in DP-rank order."""
    config = next(iter(engine.stages.values())).chunk.config
    check_prompts(prompts, prompt_mask, sampling, getattr(config, "max_position_embeddings", None))
    grid, pipeline = engine.grid, engine.pipeline
    n_stages, device = pipeline.n_stages, grid.device
    batch = len(prompts)
    first_row = grid.dp_rank * batch if first_row is None else first_row
    # pp micro-batches keep every stage busy (the token of one is back when the first stage has run the others).
    parts = [p for p in torch.arange(batch).tensor_split(min(batch, n_stages)) if len(p)]
    mask = prompt_mask.to(device).bool()
    gather = functools.partial(all_gather_cat, group=grid.tp_group, dim=-1)
    stages: dict[int, dict[int, GenerationStage]] = {}
    for r, rank_stages in engine.stages_of.items():
        handoff: dict[int, torch.Tensor] = {}
        stages[r] = {}
        for s, st in rank_stages.items():
            seqs = [Sequences(mask[p], [first_row + int(i) for i in p], st.chunk.adapter.new_cache()) for p in parts]
            stages[r][s] = GenerationStage(st.chunk, s, n_stages, device, st.dtype, seqs, sampling, gather, handoff,
                                           first_here=0 in rank_stages)
    inputs = [prompts[p].to(device) for p in parts]
    last = _last_stage(stages, n_stages)
    step, active = 0, tuple(range(len(parts)))
    with torch.no_grad(), generation_mode([st.chunk.module for st in engine.stages.values()]):
        while step < sampling.max_new_tokens and active:
            ticks = min(ticks_per_round, sampling.max_new_tokens - step)
            _run_round(engine, stages, [inputs[i] for i in active], Round(step, ticks, active))
            step += ticks
            ends, finished = _round_end(engine, last, parts, batch)
            inputs = [ends[p].to(device)[:, None] for p in parts]
            running = tuple(i for i in active if not bool(finished[parts[i]].all()))
            if grid.ep > 1:  # expert layers dispatch across replicas: they run the same forwards, all or none
                active = active if _any_replica(bool(running), grid) else ()
            else:  # a micro-batch whose rows all emitted EOS drops out of the next round
                active = running
        tokens, log_probs = _share(engine, last, (batch, step), sampling.pad_token_id)
    return rollout(prompts, prompt_mask, tokens, log_probs, sampling)


def _run_round(engine: LayoutEngine, stages: dict[int, dict[int, GenerationStage]], inputs: list[torch.Tensor],
               this_round: Round) -> None:
    """One verified generation list of the round's ticks over its micro-batches through every stage here."""
    grid, pipeline, m, ticks = engine.grid, engine.pipeline, len(this_round.active), this_round.ticks
    pp, n_stages, placement = pipeline.spec.pp, pipeline.n_stages, pipeline.placement
    lists = generation_lists(pp, n_stages, placement, m, ticks)
    rows = [len(x) for x in inputs]
    hidden = next(iter(engine.stages.values())).chunk.config.hidden_size  # the boundary's last dim
    boundary = GenerationBoundary(rows, inputs[0].shape[1], hidden)
    peer = functools.partial(generation_peer, n_microbatches=m, n_stages=n_stages, placement=placement, pp=pp)
    if engine.emulated:
        transport = LocalTransport(boundary, mate=lambda a: type(a)._make(token_mate(a, m, n_stages)))
        peer_of = peer
    else:
        transport = P2PTransport(grid.rank, boundary, grid.device, engine.spec.timeout_s)

        def peer_of(action):
            return grid.global_rank_of(peer(action), grid.dp_rank, grid.tp_rank)
    early = getattr(transport, "receives_early", False)
    programs = {r: make_program(list(lists[r]), peer_of, early, {}) for r in stages}
    for rank_stages in stages.values():
        for stage in rank_stages.values():
            stage.round = this_round
    # The first stage's first tick takes these ids; a later tick's input is a token (received or handed over).
    micro_batches = [MicroBatch(inputs[u % m], None) for u in range(ticks * m)]
    scales = StepScales(loss_scale=1.0, aux_scale=0.0)
    if engine.emulated:
        execute_emulated(programs, stages, transport, micro_batches, scales)
    else:
        r = grid.pp_rank
        execute(programs[r], stages[r], transport, micro_batches, scales)


def _last_stage(stages: dict[int, dict[int, GenerationStage]], n_stages: int) -> GenerationStage | None:
    """The stage with the head, where this process holds it."""
    return next((st for rank in stages.values() for s, st in rank.items() if s == n_stages - 1), None)


def _last_rank(engine: LayoutEngine) -> int:
    """The global rank of this replica's last pipeline rank (what holds the sampled tokens)."""
    pipeline, grid = engine.pipeline, engine.grid
    r = stage_to_rank(pipeline.n_stages - 1, pipeline.spec.pp, pipeline.placement)
    return grid.global_rank_of(r, grid.dp_rank, grid.tp_rank)


def _round_end(engine: LayoutEngine, last: GenerationStage | None, parts: list[torch.Tensor],
               batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's latest token and whether it emitted EOS, from the last pipeline rank to the others."""
    box = torch.zeros(2 * batch, dtype=torch.long, device=engine.grid.device)
    if last is not None:
        for p, seqs in zip(parts, last.sequences):
            box[p.to(box.device)] = seqs.tokens[-1]
            box[(p + batch).to(box.device)] = seqs.finished.long()
    if not engine.emulated and engine.pipeline.spec.pp > 1:
        dist.broadcast(box, src=_last_rank(engine), group=engine.grid.pp_group)
    box = box.cpu()
    return box[:batch], box[batch:].bool()


def _any_replica(running: bool, grid) -> bool:
    """Whether any DP replica still has a row before EOS."""
    flag = torch.tensor([int(running)], device=grid.device)
    return bool(all_reduce_(flag, grid.dp_group, op=dist.ReduceOp.MAX).item())


def _share(engine: LayoutEngine, last: GenerationStage | None, shape: tuple[int, int],
           pad: int) -> tuple[torch.Tensor, ...]:
    """The tokens and log-probs [B, steps] the last pipeline rank sampled, on every rank of the replica."""
    if last is not None:
        tokens, log_probs = completions(last.sequences, shape[1], pad)  # consecutive rows, in order
        packed = torch.cat([tokens.double(), log_probs.double()], dim=1)
    else:
        packed = torch.zeros(shape[0], 2 * shape[1], dtype=torch.float64, device=engine.grid.device)
    if not engine.emulated and engine.pipeline.spec.pp > 1:
        packed = packed.to(engine.grid.device).contiguous()
        dist.broadcast(packed, src=_last_rank(engine), group=engine.grid.pp_group)
    packed = packed.cpu()  # token ids are exact in float64
    return packed[:, :shape[1]].long(), packed[:, shape[1]:].float()
