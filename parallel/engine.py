"""ParallelEngine: this rank's share of a DP x TP x PP layout behind the trainer's `step(micro_batches)`.

Construction is three named steps: prepare the pipeline (`prepare_pipeline`), build this rank's stages
(`build_stages`), choose the loss and the transport; then `GradientSync` owns the step's gradient sums.
With `emulate` one process holds every pipeline rank of its (dp, tp) coordinate: the same stages, lists
and runtime loop, over in-process channels instead of P2P.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from parallel.collectives import all_reduce_
from parallel.decoder import Decoder
from parallel.expert import is_expert
from parallel.grad_sync import Bucket, GradientSync, Rider, split_buckets
from parallel.grid import ParallelGrid
from parallel.materialize import WeightSource
from parallel.pipeline.actions import Action, Kind, Lists, comm_peer
from parallel.passes import Site, build_chunk, chunk_passes
from parallel.pipeline.build import StagesByRank, build_stages
from parallel.pipeline.evaluation import forward_only
from parallel.pipeline.prepare import LoweredPipeline, prepare_pipeline
from parallel.pipeline.release import send_releases
from parallel.pipeline.runtime import Program, Record, StepScales, execute, execute_emulated, prepare
from parallel.pipeline.shm_transport import send_counts, shm_available, shm_transport
from parallel.pipeline.simulate import SimResult
from parallel.pipeline.stage import Stage
from parallel.pipeline.transport import Boundary, LocalTransport, P2PTransport, Transport
from parallel.spec import EngineSpec
from parallel.step import Engine, LocalEngine, MicroBatch, Objective, StepResult, TokenLoss, dense_token_loss
from parallel.tensor import vocab_parallel_cross_entropy

Trace = dict[int, list[Record]]  # global rank (as if distributed) -> (action, start, end), seconds from step start


def build_engine(spec: EngineSpec, decoder: Decoder, grid: ParallelGrid,
                 weights: WeightSource | None = None) -> Engine:
    """The step engine for this layout: the whole model locally when nothing is split, else this rank's share.

    The decoder may be built on the meta device; then only this rank's parameters are materialised, from `weights`."""
    if grid.world_size == 1 and spec.pipeline.pp == 1:
        whole = Site(grid, range(decoder.config.num_hidden_layers), first=True, last=True)
        return LocalEngine(build_chunk(decoder, whole, chunk_passes(spec, weights)), grid.device, spec.dtype,
                           spec.objective)
    return ParallelEngine(spec, decoder, grid, weights)


def choose_token_loss(grid: ParallelGrid, vocab_size: int) -> TokenLoss:
    """Dense cross-entropy, or the vocab-parallel one over TP-sharded logits."""
    if grid.tp == 1:
        return dense_token_loss
    return functools.partial(vocab_parallel_cross_entropy, group=grid.tp_group,
                             vocab_start=grid.tp_rank * (vocab_size // grid.tp))


def choose_transport(spec: EngineSpec, pipeline: LoweredPipeline, grid: ParallelGrid,
                     hidden_size: int) -> tuple[Transport | LocalTransport, Callable[[Action], int]]:
    """The transport and the peer-rank function: in-process channels under emulation, else shared memory when
    every rank is on this host and computes on the CPU (`parallel.transport=auto`), else torch.distributed P2P."""
    # The residual stream stays fp32 under bf16 autocast (fp32 embedding + bf16 branches), so is the boundary.
    boundary = Boundary((spec.micro_batch_size, spec.seq_len, hidden_size), torch.float32)
    n_stages, placement, pp = pipeline.n_stages, pipeline.placement, pipeline.spec.pp
    if spec.emulate:
        return LocalTransport(boundary), functools.partial(comm_peer, n_stages=n_stages, placement=placement, pp=pp)

    def peer_of(action: Action) -> int:
        return grid.global_rank_of(comm_peer(action, n_stages, placement, pp), grid.dp_rank, grid.tp_rank)

    if spec.transport != "p2p":
        usable = grid.device.type == "cpu" and shm_available()
        if spec.transport == "shm" and not usable:
            raise ValueError(f"parallel.transport=shm carries CPU tensors on Linux; this run computes on "
                             f"{grid.device.type}: use parallel.transport=auto or p2p")
        if usable:  # the same answer on every rank: all of them take part in the collective below
            slots = send_counts(pipeline.lowered[grid.pp_rank], peer_of)
            shm = shm_transport(grid.rank, boundary, spec.timeout_s, slots, required=spec.transport == "shm")
            if shm is not None:
                return shm, peer_of
    return P2PTransport(grid.rank, boundary, grid.device, spec.timeout_s), peer_of


def global_label_tokens(micro_batches: list[MicroBatch], grid: ParallelGrid,
                        count: Callable[[MicroBatch], torch.Tensor] = MicroBatch.label_tokens) -> int | torch.Tensor:
    """Label tokens of the global batch (or what else the objective's `count` counts): the data layer's stamp as
    a host int, else a device tensor.

    The data layer stamps the count on every micro-batch (it knows the whole global batch), so a training step
    needs no collective and no device op for it; unstamped micro-batches (tests, benchmarks) are counted with
    one DP all-reduce, on the device (no host sync). Every replica's data comes from the same layer, so all
    replicas take the same branch."""
    stamps = {mb.global_tokens for mb in micro_batches}
    if None in stamps:
        local = torch.stack([count(mb) for mb in micro_batches]).sum()
        return all_reduce_(local.to(grid.device), grid.dp_group)
    if len(stamps) != 1:
        raise ValueError(f"the micro-batches of one step carry different global token counts {sorted(stamps)}")
    return stamps.pop()


def loss_scale_of(tokens: int | torch.Tensor) -> float | torch.Tensor:
    """1 / tokens (at least 1) in float64; a host float and the device tensor round the same (IEEE division)."""
    return 1.0 / max(tokens, 1) if isinstance(tokens, int) else 1.0 / tokens.clamp(min=1).double()


def read_back(sums: torch.Tensor, tokens: int | torch.Tensor) -> list[float]:
    """The step's one host read: the float64 `sums`, then the token count (a host int needs no read)."""
    if isinstance(tokens, int):
        return [*sums.tolist(), tokens]
    return torch.cat([sums, tokens.double().view(1)]).tolist()


def _trained(*params: nn.Parameter | None) -> bool:
    """Whether the parameters this rank holds (None: not here) take gradients (a frozen tied pair needs no sum)."""
    return any(p is not None and p.requires_grad for p in params)


def final_backward_actions(lists: dict[int, list[Action]]) -> dict[int, Action]:
    """Per stage: the compute after which its gradients are final (its last B, or its last W under I/W)."""
    final: dict[int, Action] = {}
    for actions in lists.values():
        for action in actions:
            if action.kind in (Kind.B, Kind.W):
                final[action.stage] = action
    return final


class ParallelEngine:
    """Builds this rank's stages (pruned, TP-sharded) and runs one step: schedule, then gradient syncs."""

    def __init__(self, spec: EngineSpec, decoder: Decoder, grid: ParallelGrid, weights: WeightSource | None = None):
        self.spec, self.grid = spec, grid
        config = decoder.config
        self.pipeline = prepare_pipeline(spec.pipeline, config.num_hidden_layers)
        # Emulation: the grid has no pipeline axis (world = dp * tp) and this process plays every pipeline rank.
        self.emulated = spec.emulate
        ranks = list(range(spec.pipeline.pp)) if self.emulated else [grid.pp_rank]
        self._lists = {r: list(self.pipeline.lowered[r]) for r in ranks}
        self.objective: Objective = spec.objective
        token_loss, n_stages = choose_token_loss(grid, config.vocab_size), self.pipeline.n_stages

        def make_stage(chunk: Decoder, index: int, split: bool) -> Stage:
            return Stage(chunk, index, n_stages, grid.device, spec.dtype, token_loss, split, spec.objective)

        self.stages_of: StagesByRank = build_stages(self.pipeline, decoder, grid, ranks, chunk_passes(spec, weights),
                                                    make_stage)
        self.stages: dict[int, Stage] = {s: st for stages in self.stages_of.values() for s, st in stages.items()}
        self.transport, self.peer_of = choose_transport(spec, self.pipeline, grid, config.hidden_size)
        self.programs = self._prepare(self.pipeline.lowered)
        # A tied pair (the head and the embedding): a Parameter on the first stage and a copy on the last.
        if len(decoder.plan.ties) > 1:
            raise ValueError(f"{type(decoder.module).__name__} ties {len(decoder.plan.ties)} pairs of weights; "
                             "the pipeline keeps one tied pair (the head and the input embedding) in step")
        tied, source = next(iter(decoder.plan.ties.items()), (None, None))
        self.tied = tied is not None
        self.first = self.stages[0].chunk.parameter(source) if self.tied and 0 in self.stages else None
        last = self.stages.get(self.pipeline.n_stages - 1)
        self.head = last.chunk.parameter(tied) if self.tied and last is not None else None
        self.sync = self._gradient_sync()

    @property
    def lists(self) -> dict[int, list[Action]]:
        """This process's ranks' lowered action lists, by pipeline rank."""
        return self._lists

    @lists.setter
    def lists(self, lists: dict[int, list[Action]]) -> None:
        """Replace the lists (tests inject broken ones); the runtime's programs follow."""
        self._lists = lists
        self.programs = self._prepare([lists.get(r, self.pipeline.lowered[r]) for r in range(self.pipeline.spec.pp)])

    def _prepare(self, lists: Lists) -> dict[int, Program]:
        """This process's ranks' lists (of every rank's `lists`) as the runtime loop executes them: peers resolved,
        receives placed, and which arrival proves which send done."""
        early = getattr(self.transport, "receives_early", False)
        pipeline = self.pipeline
        return {r: prepare(list(lists[r]), self.peer_of, early,
                           send_releases(lists, r, pipeline.n_stages, pipeline.placement, pipeline.spec.pp)) for r in self.lists}

    def _gradient_sync(self) -> GradientSync:
        """Buckets per stage in backward order; the tied embedding's copy reduces over its group, then DP.

        EP-split expert parameters reduce over the edp group (the DP ranks holding the same experts) instead: the
        all_to_all already brought every ep-group rank's tokens to an expert's holder, so its gradient there holds
        their whole contribution, and the edp sum completes it to DP's without any rescaling. Frozen parameters (a pass
        may freeze the base weights) have no gradient and sit in no bucket."""
        grid, bucket_bytes = self.grid, int(self.spec.bucket_mb * 2**20)
        copies = self.tied and self.first is not self.head and _trained(self.first, self.head)
        local_tie = (self.first, self.head) if copies and self.emulated else None
        tied_here = {id(p) for p in (self.first, self.head) if copies and p is not None}
        owner = self._param_owners()
        buckets: dict[int, list[Bucket]] = {}
        for s in sorted(self.stages, key=lambda s: self._final_position(s)):
            params = [p for p in reversed(list(self.stages[s].module.parameters()))
                      if owner[id(p)] == s and id(p) not in tied_here and p.requires_grad]
            buckets[s] = []
            # Runs of consecutive dense or expert parameters keep the backward order of the buckets.
            for expert, run in itertools.groupby(params, key=is_expert):
                group, size = (grid.edp_group, grid.edp) if expert else (grid.dp_group, grid.dp)
                buckets[s] += split_buckets(list(run), bucket_bytes, (group,)) if size > 1 else []
            tied = [p for p in (self.first, self.head) if p is not None and owner.get(id(p)) == s
                    and id(p) in tied_here and not self.emulated]
            buckets[s] += [Bucket(tied, (grid.embed_group, grid.dp_group))] if tied else []
        forwards = sum(a.kind is Kind.F for actions in self.lists.values() for a in actions)
        rider = Rider(self._local_sums, forwards, grid.pp_group, pp_early=grid.device.type == "cpu")
        return GradientSync(buckets, final_backward_actions(self.lists), rider, local_tie, grid.dp_group)

    def _local_sums(self) -> torch.Tensor:
        """This process's objective sums (the loss sum first) and aux sum of the step (float64, on the device)."""
        return torch.cat([sum(s.loss_sums for s in self.stages.values()),
                          sum(s.aux_sum for s in self.stages.values()).view(1)])

    def _final_position(self, stage: int) -> int:
        """Where in its rank's list the stage's gradients become final."""
        final = final_backward_actions(self.lists)[stage]
        return next(r.index(final) for r in self.lists.values() if final in r)

    def _param_owners(self) -> dict[int, int]:
        """id(param) -> the stage whose final backward finishes it (a Parameter shared by two stages: the later)."""
        owner: dict[int, int] = {}
        for s in sorted(self.stages, key=self._final_position):
            owner.update((id(p), s) for p in self.stages[s].module.parameters())
        return owner

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
        """The parameters this rank counts in the global grad norm: each unique parameter on one rank only.

        The norm's group (`grid.mp_group`) spans tp x pp x ep: an expert counts on the ep rank holding it, a
        parameter replicated over the ep group on ep rank 0."""
        params = []
        for param in self.parameters():
            if self.grid.ep_rank != 0 and not is_expert(param):
                continue
            replicated_in_tp = not getattr(param, "tensor_parallel", False)
            if replicated_in_tp and self.grid.tp_rank != 0:
                continue  # the same gradient lives on every TP rank: count it on TP rank 0
            if self.tied and param is self.head and param is not self.first:
                continue  # the last stage's copy of the tied embedding: counted on the first stage
            params.append(param)
        return params

    def chunks(self) -> list[Decoder]:
        """The model pieces this process runs: its pipeline stages' chunks."""
        return [stage.chunk for stage in self.stages.values()]

    @property
    def planned(self) -> SimResult:
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
        records, origin = self._trace_start(trace)
        if self.emulated:
            execute_emulated(self.programs, self.stages_of, self.transport, micro_batches, scales, records)
        else:
            r = grid.pp_rank
            execute(self.programs[r], self.stages_of[r], self.transport, micro_batches, scales,
                    None if records is None else records.setdefault(r, []))
        self.sync.finish()
        sums = self.sync.step_sums()  # the loss lives on the last stage, aux on every stage
        *values, aux_sum, count = read_back(sums, tokens)
        result = StepResult(values[0] / max(count, 1), aux_sum * aux_scale, int(count),
                            metrics=self.objective.metrics(values, int(count)))
        if records is not None:
            result.trace = self._gather(records, origin)
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
        grid, programs = self.grid, self._prepare(forward_only(self.pipeline, len(micro_batches)))
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
        return all_reduce_(sums, grid.pp_group)

    def _trace_start(self, trace: bool) -> tuple[dict[int, list[Record]] | None, float]:
        """Empty records and a common time origin for every rank, when tracing."""
        if not trace:
            return None, 0.0
        if self.grid.world_size > 1:
            dist.barrier()
        return {}, time.perf_counter()

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

