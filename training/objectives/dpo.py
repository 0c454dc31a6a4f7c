"""Direct preference optimisation (DPO): a loss over whole preference pairs.

A preference micro-batch holds pairs: row 2i the chosen conversation, row 2i+1 the rejected one, each with the
reference model's summed label log-probability in its payload (`MicroBatch.extra[REFERENCE]`). The loss of a pair is
`-logsigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))` with `pi` the policy's summed label log-probability (through
the layout's token loss, so TP needs nothing of its own); the step's loss is its mean over the global batch's pairs,
as the LM loss is a mean over label tokens. A pair never straddles two micro-batches, so every layout sums the same
per-pair terms as one process.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from parallel.step import MicroBatch, TokenLoss
from training.data.pairs import REFERENCE  # the payload key the pair batches fill
from training.objectives.lm import sequence_logps


@dataclass(frozen=True)
class PreferenceLoss:
    """The DPO loss (MiniMind's train_dpo: summed log-probabilities, beta 0.1 there); rewards are beta * (pi - ref).
    Sums per micro-batch: the loss, the chosen rewards, the rejected rewards, and the pairs whose chosen reward is above
    the rejected one (float64)."""

    beta: float
    width: ClassVar[int] = 4

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor],
                 token_loss: TokenLoss) -> tuple[torch.Tensor, torch.Tensor]:
        if REFERENCE not in extra:
            raise ValueError(f"a preference micro-batch carries no {REFERENCE} (the reference log-probabilities of "
                             "its rows); compute them before training")
        if labels.shape[0] % 2:
            raise ValueError(f"a preference micro-batch holds whole pairs; it has {labels.shape[0]} rows")
        # float64 from here: a pair's margin is a small difference of sums of hundreds of token log-probabilities.
        policy = sequence_logps(logits, labels, token_loss).double()
        reference = extra[REFERENCE].to(policy.device, torch.float64)
        chosen = self.beta * (policy[0::2] - reference[0::2])  # the implicit rewards
        rejected = self.beta * (policy[1::2] - reference[1::2])
        loss_sum = -F.logsigmoid(chosen - rejected).sum()
        with torch.no_grad():
            sums = torch.stack([loss_sum, chosen.sum(), rejected.sum(), (chosen > rejected).double().sum()])
        return loss_sum, sums

    def count(self, micro_batch: MicroBatch) -> torch.Tensor:
        """Pairs: the loss is a mean over them."""
        return torch.tensor(micro_batch.labels.shape[0] // 2)

    def metrics(self, sums: list[float], count: int) -> dict[str, float]:
        """Mean chosen and rejected rewards, their mean margin, and the share of pairs ranked right."""
        n = max(count, 1)
        return {"reward_chosen": sums[1] / n, "reward_rejected": sums[2] / n, "reward_margin": (sums[1] - sums[2]) / n,
                "reward_accuracy": sums[3] / n}
