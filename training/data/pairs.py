"""Preference pairs as samples and steps: pair i is two padded chat sequences side by side (row 2i chosen, 2i+1
rejected), shuffled, split and sharded over DP as one sample, so a pair never straddles two micro-batches or
replicas; each micro-batch carries its rows' reference log-probabilities once they are computed."""

import numpy as np
import torch

from parallel.step import MicroBatch
from training.data.samples import Samples
from training.data.stream import StepBatches

REFERENCE = "ref_logps"  # the payload key: per row, the reference model's summed label log-probability [B] float64


def pair_documents(pair_ids: np.ndarray | None) -> np.ndarray | None:
    """The document ids of the given pairs (None: every pair), chosen then rejected: pair i is documents 2i, 2i+1."""
    if pair_ids is None:
        return None
    return np.stack([2 * pair_ids, 2 * pair_ids + 1], axis=1).ravel()


class PairSamples:
    """Preference pairs over row samples (padded conversations, two per pair): `take` returns the pairs' rows,
    chosen then rejected for each pair in order; `label_counts` counts 1 per pair, as the DPO loss is a mean over
    pairs (the normaliser a step stamps on its micro-batches)."""

    def __init__(self, rows: Samples):
        if len(rows) % 2:
            raise ValueError(f"preference pairs need an even number of rows, got {len(rows)}")
        self.rows = rows
        self.seq_len = rows.seq_len

    def __len__(self) -> int:
        return len(self.rows) // 2

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.take(torch.stack([2 * index, 2 * index + 1], dim=1).flatten())

    def label_counts(self, index: torch.Tensor) -> torch.Tensor:
        return torch.ones(len(index), dtype=torch.int64)


def attach_reference(micro_batches: list[MicroBatch], logps: torch.Tensor) -> list[MicroBatch]:
    """Give each micro-batch its rows' share of `logps` (one value per row, the micro-batches' rows in order)."""
    start = 0
    for mb in micro_batches:
        rows = mb.input_ids.shape[0]
        mb.extra[REFERENCE] = logps[start:start + rows]
        start += rows
    if start != len(logps):
        raise ValueError(f"{len(logps)} reference log-probabilities for {start} rows")
    return micro_batches


class PairBatches(StepBatches):
    """The step stream of preference pairs (samples are pairs); once `reference` holds the reference model's
    log-probabilities ([pairs, 2], chosen and rejected), every micro-batch carries its rows' share."""

    reference: torch.Tensor | None = None

    def pairs_read(self, steps: int) -> torch.Tensor:
        """The pairs the first `steps` steps read on any replica, ascending (every pair once a run spans an epoch)."""
        count = steps * self.global_batch_size
        if count >= self.num_samples:
            return torch.arange(self.num_samples)
        return torch.unique(self._indices(0, count))

    def batch_at(self, position: int) -> list[MicroBatch]:
        micro_batches = super().batch_at(position)
        if self.reference is None:
            return micro_batches
        logps = self.reference[self.indices_at(position)].flatten()
        if torch.isnan(logps).any():
            raise RuntimeError(f"the step at sample {position} reads preference pairs whose reference "
                               "log-probabilities were never computed (the reference pass covers train.steps steps)")
        return attach_reference(micro_batches, logps)
