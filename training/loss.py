"""The language-model loss as a token sum, so any layout can divide by the global token count."""

from collections.abc import Callable

import torch
import torch.nn.functional as F

TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def dense_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy over full-vocabulary logits [N, V] (0 where ignored)."""
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="none")


def shifted_loss_sum(logits: torch.Tensor, labels: torch.Tensor, token_loss: TokenLoss = dense_token_loss) -> torch.Tensor:
    """Sum of next-token losses: logits[:, :-1] predict labels[:, 1:]; -100 labels are skipped."""
    return token_loss(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).sum()
