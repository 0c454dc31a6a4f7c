"""ParallelEngine: this rank's share of a DP x TP x PP layout behind the trainer's `step(micro_batches)`.

Construction names its steps, each in its own module: lower the pipeline (`pipeline.lowered`), build this rank's
stages by the chunk passes (`pipeline.build`), choose the transport (`pipeline.connect`), and set up the gradient
sums (`rank_grads`). With `emulate` one process holds every pipeline rank of its (dp, tp) coordinate: the same
stages, lists and runtime loop, over in-process channels instead of P2P.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from parallel.collectives import all_reduce_
from parallel.pipeline.build import StagesByRank, build_stages, shard_built, whole_model
from parallel.pipeline.connect import choose_transport, programs_of
from parallel.pipeline.evaluation import forward_only
from parallel.generation import Rollout, Sampling
from parallel.pipeline.lowered import lower_pipeline
from parallel.pipeline.rollouts import generate_in_layout
from parallel.pipeline.runtime import Program, Timed, StepScales, execute, execute_emulated
from parallel.rank_grads import gradient_sync, norm_parameters, tied_pair
from parallel.step import Engine, LocalEngine, MicroBatch, Objective, StepResult, local_tokens, read_back

if TYPE_CHECKING:  # names in annotations only
    from parallel.decoder import Decoder
    from parallel.grid import ParallelGrid
    from parallel.materialize import WeightSource
    from parallel.pipeline.actions import Action, Lists
    from parallel.pipeline.simulate import SimResult
    from parallel.spec import EngineSpec

Trace = dict[int, list[Timed]]  # global rank (as if distributed) -> (action, start, end), seconds from step start


def build_engine(spec: EngineSpec, decoder: Decoder, grid: ParallelGrid,
                 weights: WeightSource | None = None) -> Engine:
    """The step engine for this layout: the whole model locally when nothing is split, else this rank's share.

    The decoder may be built on the meta device; then only this rank's parameters are materialised, from `weights`."""
    if grid.world_size == 1 and spec.pipeline.pp == 1:
        return LocalEngine(whole_model(spec, decoder, grid, weights), grid.device, spec.dtype, spec.objective)
    return ParallelEngine(spec, decoder, grid, weights)


def global_label_tokens(micro_batches: list[MicroBatch], grid: ParallelGrid,
                        count: Callable[[MicroBatch], torch.Tensor] = MicroBatch.label_tokens) -> int | torch.Tensor:
    """Label tokens of the global batch (or what else the objective's `count` counts): the data layer's stamp as
    a host int, else a device tensor.

    The data layer stamps the count on every micro-batch (it knows the whole global batch), so a training step
    needs no collective and no device op for it; unstamped micro-batches (tests, benchmarks) are counted with
    one DP all-reduce, on the device (no host sync). Every replica's data comes from the same layer, so all
    replicas take the same branch."""
    tokens = local_tokens(micro_batches, count, grid.device)
    return tokens if isinstance(tokens, int) else all_reduce_(tokens, grid.dp_group)


def loss_scale_of(tokens: int | torch.Tensor) -> float | torch.Tensor:
    """1 / tokens (at least 1) in float64; a host float and the device tensor round the same (IEEE division)."""
    return 1.0 / max(tokens, 1) if isinstance(tokens, int) else 1.0 / tokens.clamp(min=1).double()


class ParallelEngine:
    """Builds this rank's stages (pruned, TP-sharded) and runs one step: schedule, then gradient syncs."""

    def __init__(self, spec: EngineSpec, decoder: Decoder, grid: ParallelGrid, weights: WeightSource | None = None):
        self.spec, self.grid = spec, grid
        config = decoder.config
        self.pipeline = lower_pipeline(spec.pipeline, config.num_hidden_layers)
        # Emulation: the grid has no pipeline axis (world = dp * tp) and this process plays every pipeline rank.
        self.emulated = spec.emulate
        ranks = list(range(spec.pipeline.pp)) if self.emulated else [grid.pp_rank]
        self._lists = {r: list(self.pipeline.lowered[r]) for r in ranks}
        self.objective: Objective = spec.objective
        self.stages_of: StagesByRank = build_stages(spec, self.pipeline, decoder, grid, ranks, weights)
        self.stages = {s: st for stages in self.stages_of.values() for s, st in stages.items()}
        self.sharded = shard_built(self.stages, grid, spec, weights)
        self.transport, self.peer_of = choose_transport(spec, self.pipeline, grid, config.hidden_size)
        self.programs = self._programs_of(self.pipeline.lowered)
        self.pair = tied_pair(decoder.plan.ties, type(decoder.module).__name__, self.stages, self.pipeline.n_stages)
        self.tied, self.first, self.head = self.pair.tied, self.pair.first, self.pair.head
        self.sync = gradient_sync(self.stages, self.lists, grid, spec.bucket_mb, self.pair, self.emulated,
                                  self._local_sums, self.sharded)

    @property
    def lists(self) -> dict[int, list[Action]]:
        """This process's ranks' lowered action lists, by pipeline rank."""
        return self._lists

    @lists.setter
    def lists(self, lists: dict[int, list[Action]]) -> None:
        """Replace the lists (tests inject broken ones); the runtime's programs follow."""
        self._lists = lists
        every = [lists.get(r, self.pipeline.lowered[r]) for r in range(self.pipeline.spec.pp)]
        self.programs = self._programs_of(every)

    def _programs_of(self, lists: Lists) -> dict[int, Program]:
        """This process's ranks' lists (of every rank's `lists`) as the runtime loop executes them."""
        return programs_of(lists, self.lists, self.pipeline, self.transport, self.peer_of)

    def _local_sums(self) -> torch.Tensor:
        """This process's objective sums (the loss sum first) and aux sum of the step (float64, on the device)."""
        return torch.cat([sum(s.loss_sums for s in self.stages.values()),
                          sum(s.aux_sum for s in self.stages.values()).view(1)])

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """Every parameter this rank holds under its dense name, each Parameter once."""
        named, seen = {}, set()
        for stage in self.stages.values():
            for name, param in stage.module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    named[name] = param
        return named

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter this rank holds, each once (a tied embedding on one rank is one Parameter)."""
        return list(self.named_parameters().values())

    def norm_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank counts in the global grad norm: each unique parameter on one rank only."""
        return norm_parameters(self.parameters(), self.grid, self.pair)

    def chunks(self) -> list[Decoder]:
        """The model pieces this process runs: its pipeline stages' chunks."""
        return [stage.chunk for stage in self.stages.values()]

    @property
    def simulated_step(self) -> SimResult:
        """The simulated step (unit costs) that a trace is drawn against."""
        return self.pipeline.simulate()

    def peak_live(self) -> dict[int, int]:
        """Per pipeline rank: the most micro-batches whose saved state its stages held at once in the last step."""
        return {r: sum(s.peak_live for s in stages.values()) for r, stages in self.stages_of.items()}

    def step(self, micro_batches: list[MicroBatch], trace: bool = False) -> StepResult:
        """Forward and backward over the step's micro-batches, then tied-embedding and DP gradient sums.

        With `trace`, every rank also times each of its actions and global rank 0 receives them all."""
        grid = self.grid
        tokens = global_label_tokens(micro_batches, grid, self.objective.count)
        aux_scale = 1.0 / (len(micro_batches) * grid.dp)
        scales = StepScales(loss_scale=loss_scale_of(tokens), aux_scale=aux_scale, hooks=self.sync)
        for stage in self.stages.values():
            stage.reset()
        self.sync.start_step()
        timings, origin = self._trace_start(trace)
        if self.emulated:
            execute_emulated(self.programs, self.stages_of, self.transport, micro_batches, scales, timings)
        else:
            r = grid.pp_rank
            execute(self.programs[r], self.stages_of[r], self.transport, micro_batches, scales,
                    None if timings is None else timings.setdefault(r, []))
        self.sync.finish()
        sums = self.sync.step_sums()  # the loss lives on the last stage, aux on every stage
        *values, aux_sum, count = read_back(sums, tokens)
        result = StepResult(values[0] / max(count, 1), aux_sum * aux_scale, int(count),
                            metrics=self.objective.metrics(values, int(count)))
        if timings is not None:
            result.trace = self._gather(timings, origin)
        return result

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch]) -> StepResult:
        """Forward-only loss over the micro-batches through the same stages, transport and runtime."""
        tokens = global_label_tokens(micro_batches, self.grid, self.objective.count)
        sums = all_reduce_(self.forward_sums(micro_batches, self.objective), self.grid.dp_group)
        *values, count = read_back(sums, tokens)
        count = int(count)
        return StepResult(values[0] / max(count, 1), 0.0, count, metrics=self.objective.metrics(values, count))

    @torch.no_grad()
    def forward_sums(self, micro_batches: list[MicroBatch], objective: Objective) -> torch.Tensor:
        """Every micro-batch through every stage in eval mode, no backward, through the same stages, transport and
        runtime: `objective`'s sums over this replica's micro-batches, float64 on every pipeline rank."""
        grid, programs = self.grid, self._programs_of(forward_only(self.pipeline, len(micro_batches)))
        for stage in self.stages.values():
            stage.reset()
            stage.module.eval()
            stage.objective = objective
        try:
            scales = StepScales(loss_scale=1.0, aux_scale=0.0)
            if self.emulated:
                execute_emulated(programs, self.stages_of, self.transport, micro_batches, scales)
            else:
                r = grid.pp_rank
                execute(programs[r], self.stages_of[r], self.transport, micro_batches, scales)
            sums = sum(s.loss_sums for s in self.stages.values())  # `objective`'s width, before it is put back
        finally:
            for stage in self.stages.values():
                stage.module.train()
                stage.objective = self.objective
            self._free_gathered()
        return all_reduce_(sums, grid.pp_group)

    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
                 first_row: int | None = None) -> Rollout:
        """This DP replica's completions, generated by the generation schedule through this layout's own stages
        (`pipeline.rollouts`); every rank of the replica returns the same Rollout."""
        try:
            return generate_in_layout(self, prompts, prompt_mask, sampling, first_row)
        finally:
            self._free_gathered()

    def _free_gathered(self) -> None:
        """FSDP's groups resharded after a pass with no backward (`ShardedStage.reshard`; nothing at zero 0/1)."""
        for sharded in self.sharded.values():
            sharded.reshard()

    def _trace_start(self, trace: bool) -> tuple[dict[int, list[Timed]] | None, float]:
        """Empty timings and a common time origin for every rank, when tracing."""
        if not trace:
            return None, 0.0
        if self.grid.world_size > 1:
            dist.barrier()
        return {}, time.perf_counter()

    def _gather(self, timings: dict[int, list[Timed]], origin: float) -> Trace | None:
        """Every rank's timings, keyed by global rank and relative to the common origin, on global rank 0."""
        grid = self.grid
        mine = {grid.global_rank_of(r, grid.dp_rank, grid.tp_rank): [(a, s - origin, e - origin) for a, s, e in timed]
                for r, timed in timings.items()}
        if grid.world_size == 1:
            return mine
        gathered = [None] * grid.world_size if grid.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        return {rank: timed for part in gathered for rank, timed in part.items()} if grid.rank == 0 else None

