"""The language-model loss: next-token cross-entropy, a mean over the global batch's label tokens."""

from typing import ClassVar

import torch

from parallel.step import MicroBatch, TokenLoss, dense_token_loss


def shifted_loss_sum(logits: torch.Tensor, labels: torch.Tensor,
                     token_loss: TokenLoss = dense_token_loss) -> torch.Tensor:
    """Sum of next-token losses: logits[:, :-1] predict labels[:, 1:]; -100 labels are skipped."""
    return token_loss(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).sum()


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor,
                   token_loss: TokenLoss = dense_token_loss) -> torch.Tensor:
    """Per row of [B, S] labels: the summed log-probability of its labels (shifted, -100 skipped), float32 [B]."""
    return -token_loss(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).view(labels.shape[0], -1).sum(dim=1)


class LanguageModelLoss:
    """Next-token cross-entropy, a mean over the global batch's label tokens (pretraining and SFT)."""

    width: ClassVar[int] = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor],
                 token_loss: TokenLoss) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = shifted_loss_sum(logits, labels, token_loss)
        return loss_sum, loss_sum.detach().view(1)

    def count(self, micro_batch: MicroBatch) -> torch.Tensor:
        return micro_batch.label_tokens()

    def metrics(self, sums: list[float], count: int) -> dict[str, float]:
        return {}


LANGUAGE_MODEL = LanguageModelLoss()
