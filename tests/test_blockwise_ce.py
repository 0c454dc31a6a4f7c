"""The blockwise cross-entropy of bf16 logits equals torch's over their fp32 copy, loss and gradient (issue 37 item 3)."""

import torch
import torch.nn.functional as F

import parallel.blockwise_ce as blockwise_ce
from parallel.step import IGNORE_INDEX, dense_token_loss


def test_blockwise_ce_equals_torch_on_bf16_logits(monkeypatch):
    monkeypatch.setattr(blockwise_ce, "BLOCK_ELEMENTS", 7 * 37)  # 7 rows a block: 50 rows end in a short block
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(50, 37, generator=generator) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 37, (50,), generator=generator)
    targets[[0, 9, 49]] = IGNORE_INDEX
    upstream = torch.rand(50, generator=generator)
    mine, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = dense_token_loss(mine, targets)
    expected = F.cross_entropy(theirs.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    (loss * upstream).sum().backward()
    (expected * upstream).sum().backward()
    assert mine.grad.dtype == torch.bfloat16 and not mine.grad[[0, 9, 49]].any()
    # Each gradient is one bf16 rounding of nearly the same fp32 value: at most one bf16 ulp apart, 2u = 2^-7 = 7.8e-3
    # relative (u = 2^-8, bf16's unit roundoff), within rtol 1e-2; atol for the entries that round to near zero.
    torch.testing.assert_close(mine.grad.float(), theirs.grad.float(), rtol=1e-2, atol=1e-3)


def test_fp32_logits_take_torch_cross_entropy_itself():
    logits = torch.randn(5, 11, requires_grad=True)
    targets = torch.tensor([1, IGNORE_INDEX, 3, 10, 0])
    assert dense_token_loss(logits, targets).grad_fn.name() != "_BlockwiseCrossEntropyBackward"


def test_vocab_parallel_ce_keeps_bf16_logits_and_recomputes_the_same_gradient():
    from parallel.tensor import _VocabParallelCE

    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(20, 64, generator=generator) * 3).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 64, (20,), generator=generator)
    targets[3] = IGNORE_INDEX
    loss = _VocabParallelCE.apply(logits, targets, None, 0, IGNORE_INDEX)  # one shard: the whole vocabulary
    saved = loss.grad_fn.saved_tensors
    assert not any(t.dtype == torch.float32 and t.shape == logits.shape for t in saved)  # no fp32 [N, V] kept
    loss.sum().backward()
    reference = logits.detach().float().requires_grad_()
    expected = F.cross_entropy(reference, targets, ignore_index=IGNORE_INDEX, reduction="none")
    expected.sum().backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.float(), reference.grad.to(torch.bfloat16).float(), rtol=0, atol=0)
