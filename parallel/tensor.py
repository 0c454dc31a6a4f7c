"""Tensor parallelism's layers: column/row/vocab-parallel modules, the TP region functions, vocab-parallel
cross-entropy (the pass that puts them into a model is `parallel.tensor_pass`).

Written by hand in the Megatron/picotron style rather than with DTensor: we need exact control over
which collective runs in forward and which in backward, and local tensors whose names stay dense.
"""

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .blocks import Parts, local_block
from .blockwise_ce import cross_entropy_rows
from .collectives import all_gather_cat, all_reduce_, group_rank, group_size
from .grid import ParallelGrid

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


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's block of the last dim forward; all-gather backward (the input was replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.chunk(group_size(group), dim=-1)[group_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_cat(grad, ctx.group, dim=-1), None


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the TP region: identity forward, all-reduce of the input gradient backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the TP region by summing partial results: all-reduce forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the TP region by concatenating last-dim shards: all-gather forward, split backward."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the TP region sharded: this rank's last-dim block forward, all-gather of the gradient backward."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group)


# ---- layers ---------------------------------------------------------------------------------------------


class Branch(Protocol):
    """An additive branch beside a linear layer: `up(down(x))` joins its output, `down` running before the layer's
    collective and `up` after it, so the layer carries `down`'s result through that collective."""

    def down(self, x: torch.Tensor) -> torch.Tensor: ...

    def up(self, h: torch.Tensor) -> torch.Tensor: ...


def add_branch(linear: nn.Module, branch: Branch) -> None:
    """Give a linear layer (an nn.Linear, or a column / row-parallel one) an additive branch.

    A colwise layer enters the TP region with `down`'s result too (its gradient is summed over TP, `up` takes this
    rank's rows); a rowwise one sums it with its partial output in one all-reduce, so `up` is applied once, to the
    sum; a whole linear adds the branch after its own forward (a forward hook: its class forward stays)."""
    if getattr(linear, "branch", None) is not None:
        raise RuntimeError(f"{type(linear).__name__} already has a branch: add_branch runs once per linear")
    linear.branch = branch
    if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
        linear.register_forward_hook(_AddWhole(branch))


class _AddWhole:
    """A whole linear's forward hook adding its branch (a class, not a closure, so deepcopy rebinds it)."""

    def __init__(self, branch: Branch):
        self.branch = branch

    def __call__(self, _module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + self.branch.up(self.branch.down(args[0]))


def shard_param(tensor: torch.Tensor, partition_dim: int, packed: Parts = 1) -> nn.Parameter:
    """A Parameter marked as TP-sharded along partition_dim (the grad norm counts it on every TP rank); `packed` says
    how its parts lie (checkpoints and materialising slice by part)."""
    param = nn.Parameter(tensor.detach().clone().contiguous())
    param.tensor_parallel = True
    param.partition_dim = partition_dim
    if packed != 1:
        param.tp_packed = packed
    return param


def tp_slice(tensor: torch.Tensor, dim: int, rank: int, size: int, packed: Parts = 1) -> torch.Tensor:
    """Rank's block of tensor along dim (of each packed part)."""
    return local_block(tensor, rank, size, dim, packed)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over TP: replicated input, output sharded on the last dim."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, gather_output: bool = False):
        super().__init__()
        self.weight, self.bias, self.group, self.gather_output = weight, bias, group, gather_output
        self.out_features, self.in_features = weight.shape  # local sizes, as nn.Linear would report them
        self.branch: Branch | None = None

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: ParallelGrid, gather_output: bool = False,
                   weight: nn.Parameter | None = None, packed: Parts = 1) -> "ColumnParallelLinear":
        """Take this rank's rows of linear's weight (and bias), of each packed part; `weight` reuses an already
        sharded tie."""
        r, tp = grid.tp_rank, grid.tp
        weight = weight if weight is not None else shard_param(tp_slice(linear.weight, 0, r, tp, packed), 0, packed)
        bias = None if linear.bias is None else shard_param(tp_slice(linear.bias, 0, r, tp, packed), 0, packed)
        return cls(weight, bias, grid.tp_group, gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp_region(x, self.group), self.weight, self.bias)
        if self.branch is not None:  # its activation enters the TP region as x does: whole on every rank
            y = y + self.branch.up(copy_to_tp_region(self.branch.down(x), self.group))
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out_shard={self.out_features}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over TP: input sharded on the last dim, output all-reduced. With
    `split_input` the input arrives replicated and each rank takes its block of it (`rowwise_split_input`)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, split_input: bool = False):
        super().__init__()
        self.weight, self.bias, self.group, self.split_input = weight, bias, group, split_input
        self.out_features, self.in_features = weight.shape
        self.branch: Branch | None = None

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: ParallelGrid, split_input: bool = False,
                   packed: Parts = 1) -> "RowParallelLinear":
        """Take this rank's columns of linear's weight (of each packed part); the bias stays whole (added once,
        after the sum)."""
        weight = shard_param(tp_slice(linear.weight, 1, grid.tp_rank, grid.tp, packed), 1, packed)
        return cls(weight, linear.bias, grid.tp_group, split_input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = scatter_to_tp_region(x, self.group)
        y = F.linear(x, self.weight)
        if self.branch is None:
            y = reduce_from_tp_region(y, self.group)
        else:  # the branch's partial activation travels in the one all-reduce beside the partial output
            h = self.branch.down(x)
            y, h = reduce_from_tp_region(torch.cat([y, h.to(y.dtype)], dim=-1), self.group).split(
                [y.shape[-1], h.shape[-1]], dim=-1)
        y = y if self.bias is None else y + self.bias
        return y if self.branch is None else y + self.branch.up(h)

    def extra_repr(self) -> str:
        return f"in_shard={self.in_features}, out={self.out_features}, split_input={self.split_input}"


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
        weight = weight if weight is not None else shard_param(tp_slice(embedding.weight, 0, grid.tp_rank, grid.tp), 0)
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


class HiddenParallelEmbedding(nn.Module):
    """Embedding whose hidden columns are split over TP (`embedding_colwise`): each rank looks up its slice of every
    vector, and the slices are gathered (all-gather forward, this rank's slice of the gradient backward)."""

    def __init__(self, weight: nn.Parameter, group, padding_idx: int | None = None):
        super().__init__()
        self.weight, self.group, self.padding_idx = weight, group, padding_idx
        self.num_embeddings, self.embedding_dim = weight.shape

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, grid: ParallelGrid) -> "HiddenParallelEmbedding":
        """Take this rank's hidden columns of embedding's weight."""
        weight = shard_param(tp_slice(embedding.weight, 1, grid.tp_rank, grid.tp), 1)
        return cls(weight, grid.tp_group, embedding.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return gather_from_tp_region(F.embedding(ids, self.weight, self.padding_idx), self.group)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, dim_shard={self.embedding_dim}"


# ---- loss and logits ----------------------------------------------------------------------------------------


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy over vocab-sharded logits: three all-reduces of [N], never the full logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group, vocab_start: int, ignore_index: int):
        ctx.dtype, saved, logits = logits.dtype, logits, logits.float()
        shift = all_reduce_(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - shift.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = all_reduce_(exp.sum(dim=-1), group)
        valid = targets != ignore_index
        local = targets - vocab_start
        mine = valid & (local >= 0) & (local < logits.shape[-1])  # this shard holds the target
        local = local.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        all_reduce_(target_logit, group)
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        # The backward recomputes the softmax from the logits as they came (bf16, say) with the same ops: the same
        # numbers, without an fp32 [N, V/tp] kept per in-flight micro-batch.
        ctx.save_for_backward(saved, shift, sum_exp, local, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        saved, shift, sum_exp, local, mine, valid = ctx.saved_tensors
        softmax = (saved.float() - shift.unsqueeze(-1)).exp().div_(sum_exp.unsqueeze(-1))
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
        loss = cross_entropy_rows(flat_logits, flat_targets, ignore_index)
    else:
        loss = _VocabParallelCE.apply(flat_logits, flat_targets, group, vocab_start, ignore_index)
    return loss.view(targets.shape)


class _VocabParallelKL(torch.autograd.Function):
    """Per-row KL(p || softmax(x)) over vocab-sharded x with p's matching shard: two all-reduces of [N] for the
    normaliser, one for the sum, never the full logits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: torch.Tensor, group):
        ctx.dtype, x = x.dtype, x.float()
        shifted = x - all_reduce_(x.max(dim=-1).values, group, dist.ReduceOp.MAX).unsqueeze(-1)
        exp = shifted.exp()
        log_norm = all_reduce_(exp.sum(dim=-1), group).log()
        # sum_v p (log p - log q) with log q = shifted - log_norm; the shards' p sum to 1, so log_norm joins once.
        kl = all_reduce_((torch.xlogy(p, p) - p * shifted).sum(dim=-1), group) + log_norm
        ctx.save_for_backward(exp.div_(log_norm.exp().unsqueeze(-1)), p)
        return kl

    @staticmethod
    def backward(ctx, grad_kl: torch.Tensor):
        q, p = ctx.saved_tensors
        return ((q - p) * grad_kl.unsqueeze(-1)).to(ctx.dtype), None, None  # d KL / d x = q - p


def vocab_parallel_kl(x_shard: torch.Tensor, p_shard: torch.Tensor, group) -> torch.Tensor:
    """Per-row fp32 KL(p || softmax(x)) [N] from x [N, V/tp] and the target distribution's same shard p [N, V/tp]."""
    if group_size(group) == 1:
        return F.kl_div(F.log_softmax(x_shard.float(), dim=-1), p_shard, reduction="none").sum(dim=-1)
    return _VocabParallelKL.apply(x_shard, p_shard, group)
