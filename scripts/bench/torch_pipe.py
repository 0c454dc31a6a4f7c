"""The same pipeline in torch.distributed.pipelining: stages pruned from the dense model as Sluice prunes them,
the same partition and placement, the same token-sum loss over the global token count."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from minimind import MiniMindForCausalLM
from parallel.pipeline.partition import layer_partition, rank_stages
from parallel.pipeline.schedules import SCHEDULES
from models import decoder_of
from parallel.decoder import Decoder
from parallel.step import MicroBatch
from training.objectives.lm import shifted_loss_sum


def _counterparts() -> dict[str, type]:
    """Sluice schedule name -> torch's class its registry entry names (run at the entry's default vpp and placement);
    a name the installed torch lacks stops the benchmark here, naming the entry."""
    found = {}
    for name, registered in SCHEDULES.items():
        if registered.torch_schedule is None:
            continue
        cls = getattr(pipelining, registered.torch_schedule, None)
        if not isinstance(cls, type):
            raise ValueError(f"schedule {name!r}: torch_schedule={registered.torch_schedule!r} is not a class of "
                             f"torch.distributed.pipelining {torch.__version__}; fix its entry in "
                             "parallel/pipeline/schedules.py SCHEDULES")
        found[name] = cls
    return found


COUNTERPARTS = _counterparts()


class StageModule(nn.Module):
    """One pruned chunk behind torch's one-tensor stage interface: ids or hidden in, hidden or logits out."""

    def __init__(self, chunk: Decoder, is_first: bool, is_last: bool):
        super().__init__()
        self.chunk, self.decoder = chunk.module, chunk
        self.is_first, self.is_last = is_first, is_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.decoder(input_ids=x) if self.is_first else self.decoder(hidden=x)
        return out  # logits on the last stage


@dataclass
class TorchPipeline:
    """This rank's torch stages and schedule, and the tied-embedding copies to sum after each step."""

    schedule: object
    modules: list[StageModule]
    tied: list[nn.Parameter]  # this rank's copies of a tied embedding (first stage's and/or last stage's)
    embed_group: object  # the group of the two ranks holding them (None when one rank holds both)
    is_first: bool
    is_last: bool

    def step(self, micro_batches: list[MicroBatch], tokens: int) -> float | None:
        """One training step's forward and backward; the loss (token mean) on the last stage, else None."""
        for module in self.modules:
            module.zero_grad(set_to_none=True)
        args = (torch.cat([mb.input_ids for mb in micro_batches]),) if self.is_first else ()
        target = torch.cat([mb.labels for mb in micro_batches]) if self.is_last else None
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        self._sum_tied()
        return float(sum(loss.detach().double() for loss in losses)) if losses is not None else None

    def _sum_tied(self) -> None:
        """The tied embedding's gradient is the sum of both copies' (what Sluice's engine does too)."""
        if len(self.tied) == 2:
            total = self.tied[0].grad + self.tied[1].grad
            for p in self.tied:
                p.grad.copy_(total)
        elif self.tied and self.embed_group is not None:
            dist.all_reduce(self.tied[0].grad, group=self.embed_group)


def build(name: str, model: MiniMindForCausalLM, pp: int, n_microbatches: int, rank: int, tokens: int,
          embed_group) -> TorchPipeline:
    """torch.distributed.pipelining's counterpart of Sluice schedule `name` on pipeline rank `rank`."""
    cls, registered = COUNTERPARTS[name], SCHEDULES[name]
    vpp, placement = registered.default_vpp, registered.placement
    n_stages = pp * vpp
    partition = layer_partition(model.config.num_hidden_layers, n_stages)
    stages, modules, copies = [], [], []
    for s in rank_stages(rank, pp, vpp, placement):
        first, last = s == 0, s == n_stages - 1
        chunk = decoder_of(model).prune(partition[s], first, last)
        module = StageModule(chunk, first, last)
        for tied_name, source in chunk.plan.ties.items():
            if first:
                copies.append(chunk.parameter(source))
            if last:
                copies.append(chunk.parameter(tied_name))
        modules.append(module)
        stages.append(PipelineStage(module, s, n_stages, torch.device("cpu")))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return shifted_loss_sum(logits, labels) / tokens

    single = issubclass(cls, PipelineScheduleSingle)  # one stage per rank (GPipe, 1F1B), else a list of stages
    schedule = cls(stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return TorchPipeline(schedule, modules, copies, embed_group, any(m.is_first for m in modules),
                         any(m.is_last for m in modules))
