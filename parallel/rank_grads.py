"""Where this rank's gradients are summed and normed: DP (or edp) buckets per stage in the order backward finishes
them, the sum of the tied embedding pair, and the parameters the global grad norm counts on this rank."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from parallel.expert import is_expert
from parallel.grad_sync import Bucket, GradientSync, Rider, split_buckets
from parallel.grid import ParallelGrid
from parallel.pipeline.actions import Action, Kind
from parallel.pipeline.stage import Stage


@dataclass(frozen=True)
class TiedPair:
    """The tied input embedding and head this rank holds (None: not here); `tied`: whether the model ties them."""

    tied: bool
    first: nn.Parameter | None = None
    head: nn.Parameter | None = None


def tied_pair(ties: dict[str, str], model: str, stages: dict[int, Stage], n_stages: int) -> TiedPair:
    """A tied pair (the head and the embedding): a Parameter on the first stage and a copy on the last."""
    if len(ties) > 1:
        raise ValueError(f"{model} ties {len(ties)} pairs of weights; the pipeline keeps one tied pair (the head and "
                         "the input embedding) in step")
    if not ties:
        return TiedPair(False)
    tied, source = next(iter(ties.items()))
    last = stages.get(n_stages - 1)
    return TiedPair(True, stages[0].chunk.parameter(source) if 0 in stages else None,
                    last.chunk.parameter(tied) if last is not None else None)


def final_backward_actions(lists: dict[int, list[Action]]) -> dict[int, Action]:
    """Per stage: the compute after which its gradients are final (its last B, or its last W under I/W)."""
    final: dict[int, Action] = {}
    for actions in lists.values():
        for action in actions:
            if action.kind in (Kind.B, Kind.W):
                final[action.stage] = action
    return final


def _trained(*params: nn.Parameter | None) -> bool:
    """Whether the parameters this rank holds (None: not here) take gradients (a frozen tied pair needs no sum)."""
    return any(p is not None and p.requires_grad for p in params)


def gradient_sync(stages: dict[int, Stage], lists: dict[int, list[Action]], grid: ParallelGrid, bucket_mb: float,
                  pair: TiedPair, emulated: bool, local_sums: Callable[[], torch.Tensor],
                  sharded: dict | None = None) -> GradientSync:
    """Buckets per stage in backward order; the tied embedding's copy reduces over its group, then DP.

    EP-split expert parameters reduce over the edp group (the DP ranks holding the same experts) instead: the
    all_to_all already brought every ep-group rank's tokens to an expert's holder, so its gradient there holds
    their whole contribution, and the edp sum completes it to DP's without any rescaling. Frozen parameters (a pass
    may freeze the base weights) have no gradient and sit in no bucket; nor do FSDP's sharded ones (DTensors):
    `sharded` (stage -> FSDP root) reduces them after each stage's final backward (`parallel.fsdp_sync`)."""
    bucket_bytes, first, head = int(bucket_mb * 2**20), pair.first, pair.head
    copies = pair.tied and first is not head and _trained(first, head)
    local_tie = (first, head) if copies and emulated else None
    tied_here = {id(p) for p in (first, head) if copies and p is not None}
    final = final_backward_actions(lists)
    order = sorted(stages, key=lambda s: next(r.index(final[s]) for r in lists.values() if final[s] in r))
    owner: dict[int, int] = {}  # id(param) -> the stage whose final backward finishes it (shared: the later)
    for s in order:
        owner.update((id(p), s) for p in stages[s].module.parameters())
    buckets: dict[int, list[Bucket]] = {}
    for s in order:
        params = [p for p in reversed(list(stages[s].module.parameters()))
                  if owner[id(p)] == s and id(p) not in tied_here and p.requires_grad and not isinstance(p, DTensor)]
        buckets[s] = []
        # Runs of consecutive dense or expert parameters keep the backward order of the buckets.
        for expert, run in itertools.groupby(params, key=is_expert):
            group, size = (grid.edp_group, grid.edp) if expert else (grid.dp_group, grid.dp)
            buckets[s] += split_buckets(list(run), bucket_bytes, (group,)) if size > 1 else []
        tied = [p for p in (first, head) if p is not None and owner.get(id(p)) == s and id(p) in tied_here
                and not emulated]
        buckets[s] += [Bucket(tied, (grid.embed_group, grid.dp_group))] if tied else []
    forwards = sum(a.kind is Kind.F for actions in lists.values() for a in actions)
    rider = Rider(local_sums, forwards, grid.pp_group, pp_early=grid.device.type == "cpu")
    if sharded:
        from parallel.fsdp_sync import ShardedSync

        return ShardedSync(buckets, final, rider, local_tie, grid.dp_group, roots=sharded)
    return GradientSync(buckets, final, rider, local_tie, grid.dp_group)


def norm_parameters(params: list[nn.Parameter], grid: ParallelGrid, pair: TiedPair) -> list[nn.Parameter]:
    """Of this rank's parameters, those it counts in the global grad norm: each unique parameter on one rank only.

    The norm's group (`grid.mp_group`) spans tp x pp x ep: an expert counts on the ep rank holding it, a
    parameter replicated over the ep group on ep rank 0."""
    counted = []
    for param in params:
        # At ep = dp FSDP shards a dense parameter over the ep group itself: each rank counts its own shard.
        if grid.ep_rank != 0 and not is_expert(param) and not (isinstance(param, DTensor) and grid.edp == 1):
            continue
        replicated_in_tp = not getattr(param, "tensor_parallel", False)
        if replicated_in_tp and grid.tp_rank != 0:
            continue  # the same gradient lives on every TP rank: count it on TP rank 0
        if pair.tied and param is pair.head and param is not pair.first:
            continue  # the last stage's copy of the tied embedding: counted on the first stage
        counted.append(param)
    return counted
