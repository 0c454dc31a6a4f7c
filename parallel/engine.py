"""ParallelEngine: this rank's share of a DP x TP x PP layout behind the trainer's `step(micro_batches)`.

With `parallel.emulate=true` one process holds every pipeline rank of its (dp, tp) coordinate: the same
stages, the same lowered lists and the same runtime loop, over in-process channels instead of P2P.
"""

import functools
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from minimind import MiniMindForCausalLM
from parallel.collectives import all_reduce_
from parallel.grid import ParallelGrid
from parallel.pipeline.actions import Kind
from parallel.pipeline.partition import rank_stages
from parallel.pipeline.plan import plan_pipeline
from parallel.pipeline.prune import prune_to_stage
from parallel.pipeline.runtime import Record, StepPlan, execute, execute_emulated
from parallel.pipeline.schedules import comm_peer
from parallel.pipeline.simulate import SimResult
from parallel.pipeline.stage import Stage
from parallel.pipeline.transport import LocalTransport, P2PTransport
from parallel.spec import EngineSpec
from parallel.step import Engine, LocalEngine, MicroBatch, StepResult, dense_token_loss
from parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy

Trace = dict[int, list[Record]]  # global rank (as if distributed) -> (action, start, end), seconds from step start


def build_engine(spec: EngineSpec, model: MiniMindForCausalLM, grid: ParallelGrid) -> Engine:
    """The step engine for this layout: the whole model locally when nothing is split, else this rank's share."""
    if grid.world_size == 1 and spec.pipeline.pp == 1:
        return LocalEngine(model.to(grid.device), grid.device, spec.dtype)
    return ParallelEngine(spec, model, grid)


class ParallelEngine:
    """Builds this rank's stages (pruned, TP-sharded) and runs one step: schedule, then gradient syncs."""

    def __init__(self, spec: EngineSpec, model: MiniMindForCausalLM, grid: ParallelGrid):
        self.grid = grid
        dtype = spec.dtype
        pp, vpp, m = spec.pipeline.pp, spec.pipeline.vpp, spec.pipeline.n_microbatches
        self.n_microbatches = m
        self.plan = plan_pipeline(spec.pipeline, model.config.num_hidden_layers)
        lowered, n_stages, placement = self.plan.lowered, self.plan.n_stages, self.plan.placement
        # Emulation: the grid has no pipeline axis (world = dp * tp) and this process plays every pipeline rank.
        self.emulated = pp > grid.pp
        ranks = list(range(pp)) if self.emulated else [grid.pp_rank]
        self.lists = {r: lowered[r] for r in ranks}
        partition = self.plan.partition
        self.tied = bool(model.config.tie_word_embeddings)
        vocab_start = grid.tp_rank * (model.config.vocab_size // grid.tp)
        token_loss = dense_token_loss if grid.tp == 1 else functools.partial(
            vocab_parallel_cross_entropy, group=grid.tp_group, vocab_start=vocab_start)
        self.stages_of: dict[int, dict[int, Stage]] = {}  # pipeline rank -> its stages
        for r in ranks:
            modules = {s: prune_to_stage(model, partition[s], s == 0, s == n_stages - 1)
                       for s in rank_stages(r, pp, vpp, placement)}
            for module in modules.values():
                apply_tensor_parallel(module, grid)
                module.to(grid.device)
            if self.tied and n_stages > 1 and {0, n_stages - 1} <= modules.keys():
                # V placement: the first and last stage share a rank, so the tie is one Parameter again.
                modules[n_stages - 1].lm_head.weight = modules[0].model.embed_tokens.weight
            split = {a.stage for a in lowered[r] if a.kind is Kind.I}
            self.stages_of[r] = {s: Stage(module, s, n_stages, grid.device, dtype, token_loss, s in split)
                                 for s, module in modules.items()}
        self.stages = {s: stage for stages in self.stages_of.values() for s, stage in stages.items()}
        self.first = self.stages[0].module.model.embed_tokens.weight if 0 in self.stages else None
        last = self.stages.get(n_stages - 1)
        self.head = last.module.lm_head.weight if last is not None else None
        if self.emulated:
            self.transport = LocalTransport()
            self.peer_of = functools.partial(comm_peer, n_stages=n_stages, placement=placement, pp=pp)
        else:
            boundary = (spec.micro_batch_size, spec.seq_len, model.config.hidden_size)
            # The residual stream stays fp32 under bf16 autocast (fp32 embedding + bf16 branches), so is the boundary.
            self.transport = P2PTransport(grid.rank, boundary, torch.float32, grid.device, spec.timeout_s)
            self.peer_of = lambda action: grid.global_rank_of(comm_peer(action, n_stages, placement, grid.pp),
                                                              grid.dp_rank, grid.tp_rank)

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
        params = []
        for param in self.parameters():
            replicated_in_tp = not getattr(param, "tensor_parallel", False)
            if replicated_in_tp and self.grid.tp_rank != 0:
                continue  # the same gradient lives on every TP rank: count it on TP rank 0
            if self.tied and param is self.head and param is not self.first:
                continue  # the last stage's copy of the tied embedding: counted on the first stage
            params.append(param)
        return params

    @property
    def planned(self) -> SimResult:
        """The simulated step (unit costs) that `write_trace` draws the measured one against."""
        return self.plan.simulate()

    def peak_live(self) -> dict[int, int]:
        """Per pipeline rank: the most micro-batches whose saved state its stages held at once in the last step."""
        return {r: sum(s.peak_live for s in stages.values()) for r, stages in self.stages_of.items()}

    def step(self, micro_batches: list[MicroBatch], trace: bool = False) -> StepResult:
        """Forward and backward over the step's micro-batches, then tied-embedding and DP gradient sums.

        With `trace`, every rank also times each of its actions and global rank 0 receives them all."""
        grid = self.grid
        tokens = torch.tensor([sum(mb.num_label_tokens() for mb in micro_batches)], dtype=torch.float64)
        tokens = int(all_reduce_(tokens.to(grid.device), grid.dp_group).item())
        plan = StepPlan(loss_scale=1.0 / max(tokens, 1), aux_scale=1.0 / (self.n_microbatches * grid.dp))
        for stage in self.stages.values():
            stage.reset()
        records: dict[int, list[Record]] | None = None
        if trace:
            if grid.world_size > 1:
                dist.barrier()  # a common time origin for every rank's records
            records, origin = {}, time.perf_counter()
        if self.emulated:
            execute_emulated(self.lists, self.stages_of, self.transport, self.peer_of, micro_batches, plan, records)
        else:
            r = grid.pp_rank
            execute(self.lists[r], self.stages_of[r], self.transport, self.peer_of, micro_batches, plan,
                    None if records is None else records.setdefault(r, []))
        self._sync_gradients()
        sums = torch.stack([sum(s.loss_sum for s in self.stages.values()),
                            sum(s.aux_sum for s in self.stages.values())]).to(grid.device)
        all_reduce_(sums, grid.pp_group)  # the loss lives on the last stage, aux on every stage
        all_reduce_(sums, grid.dp_group)
        loss_sum, aux_sum = sums.tolist()
        result = StepResult(loss_sum / max(tokens, 1), aux_sum / (self.n_microbatches * grid.dp), tokens)
        if records is None:
            return result
        result.trace = self._gather(records, origin)
        return result

    def _gather(self, records: dict[int, list[Record]], origin: float) -> Trace | None:
        """Every rank's records, keyed by global rank and relative to the common origin, on global rank 0."""
        grid = self.grid
        mine = {grid.global_rank_of(r, grid.dp_rank, grid.tp_rank): [(a, s - origin, e - origin) for a, s, e in recs]
                for r, recs in records.items()}
        if grid.world_size == 1:
            return mine
        gathered = [None] * grid.world_size if grid.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        return {rank: recs for part in gathered for rank, recs in part.items()} if grid.rank == 0 else None

    def _sync_gradients(self) -> None:
        """Sum the tied embedding's two copies (first and last stage), then sum every gradient over DP."""
        grid = self.grid
        if self.tied and self.first is not self.head:
            if self.emulated:  # both copies are here: the embedding group's all-reduce, in place
                total = self.first.grad + self.head.grad
                self.first.grad.copy_(total)
                self.head.grad.copy_(total)
            elif grid.pp > 1:
                tied = self.first if self.first is not None else self.head
                if tied is not None:
                    all_reduce_(tied.grad, grid.embed_group)
        if grid.dp > 1:
            for param in self.parameters():
                if param.grad is not None:
                    all_reduce_(param.grad, grid.dp_group)


def write_trace(run_dir: str | Path, step: int, trace: Trace, planned: SimResult) -> float:
    """On global rank 0: write `trace_step{N}.json` (Chrome trace, one track per rank) and `trace_step{N}.png`
    (measured against planned); return the measured bubble fraction for metrics.jsonl."""
    from parallel.pipeline.timeline import chrome_trace, draw_measured_vs_planned, measured_bubble

    path = Path(run_dir) / f"trace_step{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(trace, name=f"step {step}")))
    draw_measured_vs_planned(planned, trace, path.with_suffix(".png"), title=f"step {step}")
    return measured_bubble(trace)
