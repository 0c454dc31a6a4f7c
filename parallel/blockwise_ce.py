"""Cross-entropy over low-precision logits that never holds them all in fp32: row blocks upcast one at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_ELEMENTS = 1 << 24  # fp32 elements upcast at once: 64 MiB, whatever the vocabulary


class _BlockwiseCrossEntropy(torch.autograd.Function):
    """Per-row fp32 CE of logits [N, V] (bf16, say), computed block by block; the backward recomputes each block's
    softmax from the saved low-precision logits instead of keeping an fp32 log-softmax of [N, V] per micro-batch."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, rows: int) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        ctx.ignore_index, ctx.rows = ignore_index, rows
        return torch.cat([F.cross_entropy(part.float(), target, ignore_index=ignore_index, reduction="none")
                          for part, target in zip(logits.split(rows), targets.split(rows))])

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, targets = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for part, target, upstream, out in zip(logits.split(ctx.rows), targets.split(ctx.rows),
                                               grad_loss.split(ctx.rows), grad.split(ctx.rows)):
            valid = target != ctx.ignore_index
            upstream = upstream.float() * valid
            # d loss / d logits = (softmax - onehot(target)) * upstream; ignored rows get 0.
            block = torch.softmax(part.float(), dim=-1).mul_(upstream.unsqueeze(-1))
            block.scatter_add_(-1, target.masked_fill(~valid, 0).unsqueeze(-1), -upstream.unsqueeze(-1))
            out.copy_(block)
        return grad, None, None, None


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Per-token fp32 cross-entropy [N] of logits [N, V] (0 where ignored): torch's own on fp32 logits, else
    upcasting BLOCK_ELEMENTS at a time."""
    if logits.dtype == torch.float32:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")
    rows = max(1, BLOCK_ELEMENTS // max(logits.shape[-1], 1))
    return _BlockwiseCrossEntropy.apply(logits, targets, ignore_index, rows)
