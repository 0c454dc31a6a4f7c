"""Knowledge distillation (MiniMind's train_distillation.py): the student learns the labels and a teacher's logits.

Per label token (the positions the LM loss counts: shifted, -100 skipped) the loss is
`alpha * CE(student, label) + (1 - alpha) * T^2 * KL(softmax(teacher / T) || softmax(student / T))`, the teacher's
logits cut to the student's vocabulary; the step's loss is its mean over the global batch's label tokens. MiniMind
takes each of its two terms as a mean over the same label tokens, so the mix is the same number.

The teacher runs here, on the last stage, forward only, on the micro-batch's token ids (`extra[TOKENS]`): its
full-vocabulary logits live for one micro-batch's loss, never for a whole step. Under TP each rank keeps the
teacher's probabilities of its own vocabulary shard and the KL's normaliser is summed over the TP group.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from parallel.collectives import group_size
from parallel.decoder import Decoder
from parallel.step import IGNORE_INDEX, MicroBatch, TokenLoss
from parallel.tensor import vocab_parallel_kl

TOKENS = "input_ids"  # the payload key: the micro-batch's token ids [B, S], the teacher's input


@dataclass(frozen=True, eq=False)
class DistillLoss:
    """The distillation loss; its sums are the loss, the CE and the `T^2`-scaled KL, each summed over label tokens.
    `tp_group` / `tp_rank`: the student's logits are the vocabulary shard `tp_rank` of the group (None: whole)."""

    teacher: Decoder  # frozen, eval mode, on the compute device
    alpha: float
    temperature: float
    tp_group: Any = None
    tp_rank: int = 0
    width: ClassVar[int] = 3

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor],
                 token_loss: TokenLoss) -> tuple[torch.Tensor, torch.Tensor]:
        if TOKENS not in extra:
            raise ValueError(f"a distillation micro-batch carries no {TOKENS} (the teacher's input) in its payload")
        student = logits[:, :-1].flatten(0, 1)
        targets = labels[:, 1:].flatten()
        ce = token_loss(student, targets)  # 0 where ignored
        counted = targets != IGNORE_INDEX
        teacher = self.teacher_probs(extra[TOKENS].to(logits.device), student.shape[-1], counted)
        kl = vocab_parallel_kl(student[counted].float() / self.temperature, teacher, self.tp_group)
        ce_sum, kl_sum = ce.sum(), kl.sum() * self.temperature ** 2
        loss_sum = self.alpha * ce_sum + (1 - self.alpha) * kl_sum
        return loss_sum, torch.stack([loss_sum, ce_sum, kl_sum]).detach()

    @torch.no_grad()
    def teacher_probs(self, input_ids: torch.Tensor, shard: int, counted: torch.Tensor) -> torch.Tensor:
        """The teacher's softened probabilities [N, shard] at the counted positions, this rank's vocabulary shard."""
        logits, _ = self.teacher(input_ids=input_ids)
        vocab = shard * group_size(self.tp_group)
        logits = logits[:, :-1].flatten(0, 1)[counted][:, :vocab].float()  # MiniMind: cut to the student's vocabulary
        probs = F.softmax(logits / self.temperature, dim=-1)
        return probs[:, self.tp_rank * shard:(self.tp_rank + 1) * shard]

    def count(self, micro_batch: MicroBatch) -> torch.Tensor:
        """Label tokens: the loss is a mean over them."""
        return micro_batch.label_tokens()

    def metrics(self, sums: list[float], count: int) -> dict[str, float]:
        """The two terms' means over label tokens, as MiniMind logs them (`ce`, `distill`: the T^2-scaled KL)."""
        n = max(count, 1)
        return {"ce_loss": sums[1] / n, "distill_loss": sums[2] / n}
