"""The held-out split: which documents validate, the same for every layout and disjoint from training."""

import numpy as np
import torch


def val_count(n_docs: int, val_fraction: float) -> int:
    """Documents held out for `val_fraction` of `n_docs`: at least one, never all (0 when the fraction is 0)."""
    if val_fraction <= 0 or n_docs < 2:
        return 0
    return min(max(1, round(val_fraction * n_docs)), n_docs - 1)


def split_documents(n_docs: int, val_fraction: float, seed: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(train document ids or None for all, validation document ids), both in file order. The held-out documents are a
    seeded random subset (data.seed), so a file sorted by length or topic still validates on a representative sample;
    whole documents, so no sequence straddles the two sides."""
    k = val_count(n_docs, val_fraction)
    if k == 0:
        return None, np.empty(0, np.int64)
    chosen = torch.randperm(n_docs, generator=torch.Generator().manual_seed(seed))[:k].numpy()
    held_out = np.zeros(n_docs, bool)
    held_out[chosen] = True
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)
