"""ParallelEngine: this rank's share of a DP x TP x PP layout behind the trainer's `step(micro_batches)`."""

import functools

import torch
from omegaconf import DictConfig
from torch import nn

from minimind import MiniMindForCausalLM
from parallel.collectives import all_reduce_
from parallel.grid import ParallelGrid
from parallel.pipeline.partition import layer_partition, rank_stages
from parallel.pipeline.prune import prune_to_stage
from parallel.pipeline.runtime import StepPlan, execute
from parallel.pipeline.schedules import SCHEDULES, comm_peer, lower
from parallel.pipeline.simulate import verify
from parallel.pipeline.stage import Stage
from parallel.pipeline.transport import P2PTransport
from parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from training.data import MicroBatch
from training.engine import StepResult
from training.loss import dense_token_loss


def lowered_schedule(cfg: DictConfig) -> tuple[list, int, str]:
    """The verified, lowered action lists of every pipeline rank, the stage count and the placement."""
    spec = SCHEDULES[cfg.schedule.name]
    pp, vpp, m = cfg.parallel.pp, cfg.parallel.vpp, cfg.schedule.n_microbatches
    n_stages = pp * vpp
    lowered = lower(spec.generate(pp, m, vpp), pp, n_stages, spec.placement)
    verify(lowered, pp, n_stages, m, spec.placement)
    return lowered, n_stages, spec.placement


class ParallelEngine:
    """Builds this rank's stages (pruned, TP-sharded) and runs one step: schedule, then gradient syncs."""

    def __init__(self, cfg: DictConfig, model: MiniMindForCausalLM, grid: ParallelGrid, dtype: torch.dtype):
        self.grid = grid
        self.n_microbatches = cfg.schedule.n_microbatches
        lowered, n_stages, placement = lowered_schedule(cfg)
        self.actions = lowered[grid.pp_rank]
        partition = layer_partition(model.config.num_hidden_layers, n_stages, cfg.parallel.layers_per_stage)
        self.tied = bool(model.config.tie_word_embeddings)
        modules = {s: prune_to_stage(model, partition[s], s == 0, s == n_stages - 1)
                   for s in rank_stages(grid.pp_rank, grid.pp, cfg.parallel.vpp, placement)}
        for module in modules.values():
            apply_tensor_parallel(module, grid)
            module.to(grid.device)
        vocab_start = grid.tp_rank * (model.config.vocab_size // grid.tp)
        token_loss = dense_token_loss if grid.tp == 1 else functools.partial(
            vocab_parallel_cross_entropy, group=grid.tp_group, vocab_start=vocab_start)
        self.stages = {s: Stage(m, s, n_stages, grid.device, dtype, token_loss) for s, m in modules.items()}
        self.first = self.stages[0].module.model.embed_tokens.weight if 0 in self.stages else None
        last = self.stages.get(n_stages - 1)
        self.head = last.module.lm_head.weight if last is not None else None
        boundary = (cfg.train.micro_batch_size, cfg.train.seq_len, model.config.hidden_size)
        # The residual stream stays fp32 under bf16 autocast (fp32 embedding + bf16 branches), so is the boundary.
        self.transport = P2PTransport(grid.rank, boundary, torch.float32, grid.device, cfg.parallel.timeout_s)
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

    def step(self, micro_batches: list[MicroBatch]) -> StepResult:
        """Forward and backward over the step's micro-batches, then tied-embedding and DP gradient sums."""
        grid = self.grid
        tokens = torch.tensor([sum(mb.num_label_tokens() for mb in micro_batches)], dtype=torch.float64)
        tokens = int(all_reduce_(tokens.to(grid.device), grid.dp_group).item())
        plan = StepPlan(loss_scale=1.0 / max(tokens, 1), aux_scale=1.0 / (self.n_microbatches * grid.dp))
        for stage in self.stages.values():
            stage.reset()
        execute(self.actions, self.stages, self.transport, self.peer_of, micro_batches, plan)
        self._sync_gradients()
        sums = torch.stack([sum(s.loss_sum for s in self.stages.values()),
                            sum(s.aux_sum for s in self.stages.values())]).to(grid.device)
        all_reduce_(sums, grid.pp_group)  # the loss lives on the last stage, aux on every stage
        all_reduce_(sums, grid.dp_group)
        loss_sum, aux_sum = sums.tolist()
        return StepResult(loss_sum / max(tokens, 1), aux_sum / (self.n_microbatches * grid.dp), tokens)

    def _sync_gradients(self) -> None:
        """Sum the tied embedding's two copies (first and last stage), then sum every gradient over DP."""
        grid = self.grid
        if self.tied and grid.pp > 1 and self.first is not self.head:
            tied = self.first if self.first is not None else self.head
            if tied is not None:
                all_reduce_(tied.grad, grid.embed_group)
        if grid.dp > 1:
            for param in self.parameters():
                if param.grad is not None:
                    all_reduce_(param.grad, grid.dp_group)
