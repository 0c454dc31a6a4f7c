"""Fully sharded data parallelism (`parallel.zero=2/3`): torch's FSDP2 `fully_shard` as one more pass over built stages.

Each stage's chunk, once the chunk passes (pruning, TP, EP, adapters, recompute, compile) have run, is sharded over
the data-parallel mesh: one FSDP group per decoder layer, one for the pieces around the layers (embedding, final
norms, head), and the chunk's module as the root. The pass runs after the stages exist, not inside the chunk pass
list, because V placement re-ties the embedding and head of two chunks on one rank after they are built, and one
Parameter must not enter two FSDP groups. It shards the chunk while still on the meta device, then materialises it:
each rank reads every dense tensor once and keeps only its shard (`materialize_`), so it never holds its stage
whole, whether the weights come from the seeded initialisation or `checkpoint.load_dense`.

A parameter FSDP cannot manage here stays whole and keeps the data-parallel buckets of `grad_sync`: a tied embedding
pair (one Parameter in two chunks, or two copies summed over the embedding group), a parameter whose gradient a hook
changes (TP's replicated weights summed over TP: FSDP replaces the Parameter, and the hook would be lost), and
EP-split experts (their stacked module is a container FSDP cannot wrap; they keep the bucketed sum over the edp
group). The root owns no parameter: the chunk is never called as a module (the Decoder calls its pieces), so FSDP's
root hooks never run and the pieces' groups gather their own weights.

Gradients are reduced as a sum (the loss is already scaled by the global batch's tokens). At zero=3 each layer's
gradients are reduce-scattered after every micro-batch's backward and accumulate as shards, and its gathered weights
are freed after each forward and each backward (the head's group, run last forward and first backward, after the
backward): a step holds one layer's weights and gradients whole at a time beside the head's group, at the price of a
gather per forward and backward and a reduce-scatter per micro-batch. At zero=2, and on a stage whose
backward is split into I and W (zero-bubble: W's weight gradients come after I, where FSDP's hook runs), the weights
stay gathered and the gradients accumulate unsharded until the stage's last backward, then are reduce-scattered once
(`ShardedSync`, as torch's pipelining does). By default (`parallel.mixed_precision_param=fp32`) compute precision
stays autocast's (`train.dtype`), so the gathered weights keep the master dtype and every layout computes the same
numbers; at bf16 FSDP gathers and computes in bf16 and reduces in fp32 (`policies`). `parallel.cpu_offload` keeps the
shards in CPU memory (CUDA only).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from parallel.decoder import submodule
from parallel.materialize import WeightSource, is_meta, materialize_
from parallel.spec import ShardSpec
from parallel.tensor_pass import grad_summed_params, sync_replicated_grads

if TYPE_CHECKING:  # names in annotations only
    from parallel.grid import ParallelGrid
    from parallel.pipeline.stage import Stage

LEVELS = (2, 3)  # parallel.zero values that shard with FSDP (0 and 1 keep whole parameters)


@dataclass(frozen=True)
class ShardedStage:
    """A stage's FSDP root, and whether its layers reduce and reshard after every backward (zero=3, no I/W split)."""

    root: FSDPModule
    per_microbatch: bool

    def reshard(self) -> None:
        """Free every gathered group after a forward-only pass (reference, rollouts, validation): a group kept gathered
        from its forward to a backward that never comes (the head's at zero=3, every one at zero=2) would otherwise
        carry weights the next optimizer step makes stale into the next forward."""
        for module in self.root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


@dataclass(frozen=True)
class ShardMeshes:
    """The mesh parameters shard over: the DP ranks of this (pp, tp) coordinate."""

    dense: DeviceMesh  # (dp) or, under HSDP and EP, (dp_replicate, dp_shard)


def shard_meshes(grid: ParallelGrid, replicate: int, timeout: timedelta) -> ShardMeshes:
    """The meshes of `grid` (a collective on every rank: HSDP creates its process groups).

    Under EP the dense parameters shard over the edp group too, replicated over the ep group (HSDP's shape): then
    every rank of a shard group counts the same parameters in the global grad norm (dense ones on ep rank 0); at
    ep = dp the dense ones shard over all of DP."""
    kind, at = grid.device.type, grid.global_rank_of
    if grid.ep > 1 and grid.edp > 1:
        ranks = torch.tensor([[at(grid.pp_rank, e * grid.ep + i, grid.tp_rank) for e in range(grid.edp)]
                              for i in range(grid.ep)])
        dense = DeviceMesh.from_group([grid.ep_group, grid.edp_group], kind, mesh=ranks,
                                      mesh_dim_names=("dp_replicate", "dp_shard"))
        return ShardMeshes(dense)
    if replicate == 1:
        return ShardMeshes(grid.mesh["dp"])
    shard = grid.dp // replicate
    coords = [(p, t) for p in range(grid.pp) for t in range(grid.tp)]
    shards = grid._my_group([[at(p, r * shard + s, t) for s in range(shard)]
                             for p, t in coords for r in range(replicate)], timeout)
    replicas = grid._my_group([[at(p, r * shard + s, t) for r in range(replicate)]
                               for p, t in coords for s in range(shard)], timeout)
    ranks = torch.tensor([[at(grid.pp_rank, r * shard + s, grid.tp_rank) for s in range(shard)]
                          for r in range(replicate)])
    dense = DeviceMesh.from_group([replicas, shards], kind, mesh=ranks, mesh_dim_names=("dp_replicate", "dp_shard"))
    return ShardMeshes(dense)


def kept_whole(stages: dict[int, Stage], grid: ParallelGrid) -> set[nn.Parameter]:
    """The parameters FSDP leaves whole (see the module's docstring): they keep the DP buckets."""
    chunks: dict[int, int] = {}  # id(param) -> the chunks holding it
    kept: set[nn.Parameter] = {p for stage in stages.values() for p in grad_summed_params(stage.chunk, grid)}
    for stage in stages.values():
        module, ties = stage.module, stage.chunk.plan.ties
        for param in module.parameters():
            chunks[id(param)] = chunks.get(id(param), 0) + 1
        for name, param in module.named_parameters():
            twin = stage.chunk.parameter(ties[name]) if name in ties else None
            copy = name in ties.values() or name in ties  # one half of a tied pair...
            one_here = twin is param or any(stage.chunk.parameter(t) is param for t, s in ties.items() if s == name)
            if (copy and not one_here) or getattr(param, "expert_parallel", False):
                kept.add(param)  # ...unless both halves are this one Parameter, in one FSDP group here
    for stage in stages.values():
        kept.update(p for p in stage.module.parameters() if chunks[id(p)] > 1)
    return kept


def shard_stages(stages: dict[int, Stage], grid: ParallelGrid, spec: ShardSpec, timeout: timedelta,
                 weights: WeightSource | None) -> dict[int, ShardedStage]:
    """Shard every stage this process holds (in stage order), fill a meta stage from `weights` (each rank its own
    shards, the parameters FSDP leaves whole whole), add TP's gradient sums to those; return each stage's FSDP root.
    With bf16 gathers a stage computes under bf16 autocast whatever `train.dtype` says: the parameters FSDP leaves
    whole meet bf16 inputs."""
    meshes = shard_meshes(grid, spec.replicate, timeout)
    kept = kept_whole(stages, grid)
    for stage in stages.values():
        stage.dtype = stage.dtype if spec.param_dtype == torch.float32 else spec.param_dtype
    roots = {index: _shard_chunk(stages[index], meshes, kept, spec) for index in sorted(stages)}
    for index, root in roots.items():
        chunk = stages[index].chunk
        if is_meta(chunk.module):
            materialize_(chunk, weights, grid.tp_rank, grid.tp, grid.device)
        sync_replicated_grads(chunk, grid)  # after materialising: a meta tensor's hooks would not survive it
        fully_shard.state(root)._lazy_init()  # the root by construction: the chunk is never called as a module
    return {index: ShardedStage(root, spec.level == 3 and stages[index].weight_grads is None)
            for index, root in roots.items()}


def _shard_chunk(stage: Stage, meshes: ShardMeshes, kept: set[nn.Parameter], spec: ShardSpec) -> FSDPModule:
    chunk, module = stage.chunk, stage.module
    marks = {name: _marks(p) for name, p in module.named_parameters()}
    options = {"mesh": meshes.dense, "reshard_after_forward": spec.level == 3, **policies(spec)}
    for _, layer in chunk.blocks():
        fully_shard(layer, **options, ignored_params=_within(layer, kept))
    ends = [m for name in (chunk.plan.embedding, *chunk.plan.finals, chunk.plan.head)
            if (m := submodule(module, name)) is not None]
    if any(p not in kept for m in ends for p in m.parameters()):
        # The group holding the head runs last in the forward and first in the backward: resharded after the forward
        # it would be gathered again at once, so it stays gathered in between, as FSDP's root group does (one gather
        # of the largest group saved per micro-batch; the backward reshards it, so the step's peak is the same).
        head_here = submodule(module, chunk.plan.head) is not None
        fully_shard(ends, **{**options, "reshard_after_forward": options["reshard_after_forward"] and not head_here},
                    ignored_params={p for m in ends for p in m.parameters() if p in kept})
    left = {p for p in module.parameters() if not isinstance(p, DTensor)}
    root = fully_shard(module, **options, ignored_params=left)
    for inner in module.modules():
        if isinstance(inner, FSDPModule):
            # A sum over DP (the loss is scaled by the global batch already), as plain SUM collectives: gloo has no
            # PREMUL_SUM, and a factor of 1 then skips the division.
            inner.set_gradient_divide_factor(1.0)
            inner.set_force_sum_reduction_for_comms(True)
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            for attr, value in marks.get(name, {}).items():
                setattr(param, attr, value)
    return root


def policies(spec: ShardSpec) -> dict:
    """`fully_shard`'s precision and offload policies: at bf16, weights gathered and computed in bf16, gradients
    reduced in fp32 into the fp32 master shards, each sharded module's output cast back to fp32 (the boundary's and the
    residual stream's dtype); with `cpu_offload` the shards, their gradients and so AdamW's step live in CPU memory."""
    mixed = spec.param_dtype != torch.float32
    return {"mp_policy": MixedPrecisionPolicy(spec.param_dtype, torch.float32, torch.float32) if mixed
            else MixedPrecisionPolicy(), "offload_policy": CPUOffloadPolicy() if spec.cpu_offload else OffloadPolicy()}


def _within(module: nn.Module, kept: set[nn.Parameter]) -> set[nn.Parameter]:
    return {p for p in module.parameters() if p in kept}


def _marks(param: nn.Parameter) -> dict:
    """The marks passes set on a Parameter (TP's partition dim, EP's block): FSDP's sharded one is a new object."""
    return {k: v for k, v in vars(param).items() if not k.startswith("_")}


def begin_step(stages: dict[int, ShardedStage]) -> None:
    """Each micro-batch reduces and reshards (`per_microbatch`), or the gradients accumulate unreduced and unsharded
    and the weights stay gathered until the stage's last backward (`reduce_stage`)."""
    for stage in stages.values():
        stage.root.set_is_last_backward(False)
        stage.root.set_reshard_after_backward(stage.per_microbatch)
        stage.root.set_requires_gradient_sync(stage.per_microbatch)


def reduce_stage(root: FSDPModule) -> None:
    """After a stage's last backward of the step: reduce-scatter (and all-reduce over replicas) its gradients and
    reshard, as torch's pipelining does (`_PipelineStageBase.perform_reduce_grad`): the schedule's backward never
    calls `.backward()` on the module, so FSDP's own end-of-backward runs here, by hand."""
    root.set_is_last_backward(True)
    root.set_reshard_after_backward(True)
    root.set_requires_gradient_sync(True)
    state = fully_shard.state(root)
    for inner in state._state_ctx.all_states:
        for group in inner._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor's local shard), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
