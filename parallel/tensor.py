"""Tensor parallelism: column/row/vocab-parallel layers, vocab-parallel cross-entropy, and the TP pass.

Written by hand in the Megatron/picotron style rather than with DTensor: we need exact control over
which collective runs in forward and which in backward, and local tensors whose names stay dense.
"""

import math
import re
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import all_gather_cat, all_reduce_, group_rank, group_size
from .grid import ParallelGrid

# MiniMind's plan (like Qwen3's before transformers added it) omits the per-head q/k norms: their weight
# is replicated but each TP rank only sees its own heads, so its gradient is partial and must be summed.
# Entries in the model's own plan win over these.
# ---- autograd communication -------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce backward (the input is replicated, each rank's grad is partial)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_(grad.clone(), ctx.group), None  # clone: autograd may share grad with other nodes


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (partial sums -> full); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return all_reduce_(x.clone(), group)  # clone: an input of a Function is not ours to overwrite

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_gather_cat(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(group_size(ctx.group), dim=-1)[group_rank(ctx.group)].contiguous(), None


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the TP region: identity forward, all-reduce of the input gradient backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the TP region by summing partial results: all-reduce forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the TP region by concatenating last-dim shards: all-gather forward, split backward."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


# ---- layers ---------------------------------------------------------------------------------------------


def _shard_param(tensor: torch.Tensor, partition_dim: int) -> nn.Parameter:
    """A Parameter marked as TP-sharded along partition_dim (the grad norm counts it on every TP rank)."""
    param = nn.Parameter(tensor.detach().clone().contiguous())
    param.tensor_parallel = True
    param.partition_dim = partition_dim
    return param


def _slice(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank's contiguous 1/size block of tensor along dim."""
    return tensor.chunk(size, dim=dim)[rank]


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over TP: replicated input, output sharded on the last dim."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, gather_output: bool = False):
        super().__init__()
        self.weight, self.bias, self.group, self.gather_output = weight, bias, group, gather_output
        self.out_features, self.in_features = weight.shape  # local sizes, as nn.Linear would report them

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: ParallelGrid, gather_output: bool = False,
                   weight: nn.Parameter | None = None) -> "ColumnParallelLinear":
        """Take this rank's rows of linear's weight (and bias); `weight` reuses an already sharded tie."""
        weight = weight if weight is not None else _shard_param(_slice(linear.weight, 0, grid.tp_rank, grid.tp), 0)
        bias = None if linear.bias is None else _shard_param(_slice(linear.bias, 0, grid.tp_rank, grid.tp), 0)
        return cls(weight, bias, grid.tp_group, gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp_region(x, self.group), self.weight, self.bias)
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out_shard={self.out_features}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over TP: input sharded on the last dim, output all-reduced."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: ParallelGrid) -> "RowParallelLinear":
        """Take this rank's columns of linear's weight; the bias stays whole (added once, after the sum)."""
        weight = _shard_param(_slice(linear.weight, 1, grid.tp_rank, grid.tp), 1)
        return cls(weight, linear.bias, grid.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_shard={self.in_features}, out={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows [vocab_start, vocab_end) live on this rank; other ids give 0, then all-reduce."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group, padding_idx: int | None = None):
        super().__init__()
        self.weight, self.group, self.padding_idx = weight, group, padding_idx
        self.vocab_start, self.vocab_end = vocab_start, vocab_start + weight.shape[0]
        self.embedding_dim = weight.shape[1]

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, grid: ParallelGrid,
                   weight: nn.Parameter | None = None) -> "VocabParallelEmbedding":
        """Take this rank's vocab rows of embedding's weight; `weight` reuses an already sharded tie."""
        weight = weight if weight is not None else _shard_param(_slice(embedding.weight, 0, grid.tp_rank, grid.tp), 0)
        start = grid.tp_rank * weight.shape[0]
        pad = embedding.padding_idx
        local_pad = pad - start if pad is not None and start <= pad < start + weight.shape[0] else None
        return cls(weight, start, grid.tp_group, local_pad)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        out = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight, self.padding_idx)
        return reduce_from_tp_region(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        return f"vocab=[{self.vocab_start}, {self.vocab_end}), dim={self.embedding_dim}"


# ---- the pass ---------------------------------------------------------------------------------------------


def check_tp_divisibility(config, tp: int) -> None:
    """Raise ValueError naming the first config size that tp does not divide, and the valid choices."""
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size}
    if getattr(config, "use_moe", False):
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    sizes["vocab_size"] = config.vocab_size
    common = math.gcd(*sizes.values())
    choices = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {name}={size}; choose tp in {{{choices}}}")


def _pattern(plan_key: str) -> re.Pattern:
    """Plan key with `*` wildcards (one name component each) -> compiled full-match regex."""
    return re.compile(re.escape(plan_key).replace(r"\*", r"[^.]+"))


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Module-name pattern -> style for the whole model: base-model plan (prefixed) plus the head's plan."""
    base = getattr(model, "base_model", model)
    prefix = "" if base is model else f"{model.base_model_prefix}."
    base_plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    plan = {f"{prefix}{k}": v for k, v in base_plan.items()}
    if base is model:
        return plan
    # Logits stay vocab-sharded: the loss is vocab_parallel_cross_entropy, which never gathers them.
    head_plan = getattr(type(model), "_tp_plan", None) or {}
    return {**plan, **{k: "colwise" if v == "colwise_gather_output" else v for k, v in head_plan.items()}}


def _all_reduce_grad(grad: torch.Tensor, group) -> torch.Tensor:
    """Sum a replicated parameter's partial gradient over TP (runs inside backward, every micro-batch)."""
    return all_reduce_(grad.clone(), group)


def apply_tensor_parallel(model: nn.Module, grid: ParallelGrid) -> nn.Module:
    """Shard the plan's modules, then hook the replicated parameters' gradient sums (both steps below)."""
    shard_modules(model, grid)
    sync_replicated_grads(model, grid)
    return model


def shard_modules(model: nn.Module, grid: ParallelGrid) -> nn.Module:
    """Replace the plan's Linear/Embedding modules in place by TP versions holding this rank's slice.

    Parameter names stay dense; modules absent from a pruned model are skipped; a Parameter shared by
    several modules (tied embedding and lm_head) stays one shared sharded Parameter. Works on meta modules.
    """
    check_tp_divisibility(model.config, grid.tp)
    if grid.tp == 1:
        return model
    shards: dict[int, nn.Parameter] = {}  # id(dense weight) -> its dim-0 shard, reused by a tie partner
    # The list keeps every dense module (and weight) alive through the loop, so no id() is recycled.
    for name, module, style in _planned_modules(model):
        if style != "replicated_with_grad_allreduce":
            new = _parallel_module(module, style, grid, shards)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    return model


def sync_replicated_grads(model: nn.Module, grid: ParallelGrid) -> None:
    """Replicated parameters that see only part of the sharded activations sum their gradient over TP.

    A leaf hook, not a trainer step: the gradient is exact as soon as backward returns. Registered after the
    weights are materialised, since a meta tensor's hooks do not survive getting storage."""
    if grid.tp == 1:
        return
    for _, module, style in _planned_modules(model):
        if style == "replicated_with_grad_allreduce":
            for param in module.parameters(recurse=False):
                param.register_hook(partial(_all_reduce_grad, group=grid.tp_group))


def _planned_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, module, style) of every module the TP plan names."""
    rules = [(_pattern(key), style) for key, style in tp_plan(model).items()]
    found = []
    for name, module in list(model.named_modules()):
        style = next((s for pattern, s in rules if pattern.fullmatch(name)), None)
        if style is not None:
            found.append((name, module, style))
    return found


def _parallel_module(module: nn.Module, style: str, grid: ParallelGrid, shards: dict) -> nn.Module:
    """The TP replacement of one dense module under style."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
        raise ValueError(f"apply_tensor_parallel: model already has TP modules ({type(module).__name__})")
    tied = shards.get(id(module.weight))
    if style in ("colwise", "colwise_gather_output") and isinstance(module, nn.Linear):
        new = ColumnParallelLinear.from_dense(module, grid, style == "colwise_gather_output", weight=tied)
    elif style == "rowwise" and isinstance(module, nn.Linear):
        new = RowParallelLinear.from_dense(module, grid)
    elif style == "embedding_rowwise" and isinstance(module, nn.Embedding):
        new = VocabParallelEmbedding.from_dense(module, grid, weight=tied)
    else:
        raise ValueError(f"apply_tensor_parallel: style {style!r} does not apply to {type(module).__name__}")
    if style != "rowwise":  # only row-sliced (dim 0) shards can stand for a tied partner
        shards[id(module.weight)] = new.weight
    return new


# ---- loss and logits ----------------------------------------------------------------------------------------


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy over vocab-sharded logits: three all-reduces of [N], never the full logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group, vocab_start: int, ignore_index: int):
        ctx.dtype, logits = logits.dtype, logits.float()
        shifted = logits - all_reduce_(logits.max(dim=-1).values, group, dist.ReduceOp.MAX).unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = all_reduce_(exp.sum(dim=-1), group)
        valid = targets != ignore_index
        local = targets - vocab_start
        mine = valid & (local >= 0) & (local < logits.shape[-1])  # this shard holds the target
        local = local.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        all_reduce_(target_logit, group)
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, mine, valid = ctx.saved_tensors
        grad_loss = grad_loss * valid
        # d loss / d logits = softmax - onehot(target): the onehot part only on the shard holding the target.
        grad = softmax * grad_loss.unsqueeze(-1)
        grad.scatter_add_(-1, local.unsqueeze(-1), -(grad_loss * mine).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, group, vocab_start: int,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token fp32 CE losses [N] (0 where ignored) from logits [N, V/tp] holding vocab [vocab_start, +V/tp)."""
    flat_logits, flat_targets = logits_shard.reshape(-1, logits_shard.shape[-1]), targets.reshape(-1)
    if group_size(group) == 1:
        loss = F.cross_entropy(flat_logits.float(), flat_targets, ignore_index=ignore_index, reduction="none")
    else:
        loss = _VocabParallelCE.apply(flat_logits, flat_targets, group, vocab_start, ignore_index)
    return loss.view(targets.shape)
