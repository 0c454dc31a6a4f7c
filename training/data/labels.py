"""Samples without a label token: chat samples (or one side of DPO pairs) whose every assistant token lies beyond
train.seq_len train on nothing and measure nothing. One rule for every split and side: refused above
MAX_UNLABELED_SHARE, named with its share otherwise."""

from dataclasses import dataclass

import numpy as np
import torch

from training.data.samples import Samples

# Above this share of samples without a label inside seq_len, most steps would train on (almost) nothing.
MAX_UNLABELED_SHARE = 0.5
SAMPLED = 2000  # samples looked at per split and side: label counts read rows, so a large set is sampled
SIDES = ("chosen", "rejected")  # a DPO pair's rows, in order
FIX = "raise train.seq_len or use shorter conversations"


def percent(share: float) -> str:
    """A share as a percentage that never reads 0% or 100% unless it is."""
    shown = f"{share:.0%}"
    if shown in ("0%", "100%") and 0 < share < 1:
        return f"{share:.1%}"
    return shown


@dataclass(frozen=True)
class Unlabeled:
    """The share of one split's samples (or of one side of its pairs) that hold no label token within seq_len."""

    key: str  # the config key of the source: data.path, data.val_path, or data.val_fraction for a held-out share
    what: str  # "chat samples", "chosen conversations", "rejected conversations"
    held_out: bool
    share: float
    checked: int
    seq_len: int

    def _finding(self) -> str:
        return (f"{self.key}: in {percent(self.share)} of the {self.what} ({self.checked} checked) every assistant "
                f"token lies beyond train.seq_len={self.seq_len}")

    def _effect(self) -> str:
        return "validation would measure nothing on them" if self.held_out else "they would train on nothing"

    @property
    def refused(self) -> bool:
        return self.share > MAX_UNLABELED_SHARE

    def refusal(self) -> str:
        """One line: the split (or side) cannot train or be measured, and the fix."""
        return f"{self._finding()}, so {self._effect()}; {FIX}"

    def warning(self) -> str:
        """One line: the share that trains (or measures) nothing, its cause and the fix."""
        return f"{self._finding()}; {self._effect()} ({FIX})"


def unlabeled(samples: Samples, key: str, held_out: bool, preference: bool) -> list[Unlabeled]:
    """The unlabeled share of a split: of its chat samples, or of each side of its DPO pairs (`samples.rows`, chosen
    at even rows, rejected at odd ones) apart, as a side that is all beyond seq_len leaves the pairs with nothing to
    compare even while the other side keeps half of the rows labelled."""
    n = len(samples)
    index = torch.from_numpy(np.unique(np.linspace(0, n - 1, min(n, SAMPLED)).astype(np.int64)))  # evenly spaced
    if preference:
        looks = [(samples.rows, 2 * index + side, f"{name} conversations") for side, name in enumerate(SIDES)]
    else:
        looks = [(samples, index, "chat samples")]
    found = []
    for rows, picked, what in looks:
        share = float((rows.label_counts(picked) == 0).double().mean()) if len(picked) else 0.0
        found.append(Unlabeled(key, what, held_out, share, len(picked), samples.seq_len))
    return found
