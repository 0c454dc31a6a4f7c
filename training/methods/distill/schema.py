"""The `distill` section of the run config (`train.task=distill`), in a file of its own to keep schema.py short."""

from dataclasses import dataclass
from typing import Optional

from training.rules.keys import ReadWhen, key
from training.rules.values import fraction, optional, positive, text

DISTILL_ONLY = ReadWhen("train.task", ("distill",), refuse=True)
DISTILL_SETTING = ReadWhen("train.task", ("distill",), refuse=False)


@dataclass
class DistillSchema:
    """Knowledge distillation (`train.task=distill`): the student learns the labels and a teacher's logits."""

    teacher: Optional[str] = key(
        None, "the teacher: an HF folder (save_pretrained, `scripts/export_hf.py`), a MiniMind `.pth` (its config read "
        "from its shapes) or a Sluice run directory or training checkpoint; any size, its vocabulary at least the "
        "student's (its logits are cut to it); it runs forward only, whole, on the last stage's ranks", optional(text),
        DISTILL_ONLY)
    alpha: float = key(0.5, "the loss is `alpha * CE + (1 - alpha) * T^2 * KL(teacher || student)` per label token, "
                            "softmaxes at temperature `T` (MiniMind's train_distillation.py: 0.5)",
                       fraction(closed_top=True), DISTILL_SETTING)
    temperature: float = key(1.5, "the softmax temperature `T` of the KL term (MiniMind's default 1.5)", positive,
                             DISTILL_SETTING)
