"""The step stream: one optimizer step's micro-batches for one DP replica, in a layout-independent order."""

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from parallel.step import MicroBatch
from training.data.samples import Samples
from training.data.spec import DataError


class StepBatches:
    """Infinite iterator over optimizer steps: each `next()` is this DP replica's `list[MicroBatch]`.

    Global order contract (what makes layouts numerically equivalent): epoch e is
    `randperm(N, Generator(seed + e))` (`arange(N)` without `shuffle`); the global stream is the concatenation of epochs; a step starting at
    global position p (samples consumed so far) consumes [p, p + G) with G = dp_size * n_microbatches *
    micro_batch_size; replica d takes [p + d*M, p + (d+1)*M) with M = n_microbatches * micro_batch_size, split
    in order into micro-batches. The position counts samples, not steps, so a resume with another DP size or
    micro-batch split continues at the same sample. A sample may be several sequences (a preference pair is two,
    side by side): `micro_batch_size` counts samples, and a micro-batch holds its samples' sequences in order.
    """

    held_out: Samples | None = None  # the held-out split beside these samples (the run header reports its size)

    def __init__(self, samples: Samples, micro_batch_size: int, n_microbatches: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, skipped_lines: int = 0, shuffle: bool = True) -> None:
        if micro_batch_size < 1 or n_microbatches < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and n_microbatches ({n_microbatches}) must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        self.samples = samples
        self.micro_batch_size, self.n_microbatches = micro_batch_size, n_microbatches
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.replica_batch_size = n_microbatches * micro_batch_size  # M
        self.global_batch_size = dp_size * self.replica_batch_size  # G
        self.num_samples, self.seq_len = len(samples), samples.seq_len
        self.skipped_lines = skipped_lines  # bad JSONL lines skipped with data.skip_bad_lines (for the metrics)
        if self.num_samples < self.global_batch_size:
            raise DataError(f"the data set has {self.num_samples} sequences of {self.seq_len} tokens, fewer than one "
                            f"global batch of {self.global_batch_size} = dp {dp_size} x schedule.n_microbatches "
                            f"{n_microbatches} x train.micro_batch_size {micro_batch_size}; use more data "
                            "(data.num_docs or a larger data.path), a shorter train.seq_len, or a smaller global batch")
        self.position = 0  # global samples consumed: the start of the next step
        self._perms: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of `epoch`; only the two most recent epochs are kept."""
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perms[epoch] = (torch.randperm(self.num_samples, generator=generator) if self.shuffle
                                  else torch.arange(self.num_samples))
        return self._perms[epoch]

    def _indices(self, start: int, count: int) -> torch.Tensor:
        """Indices (into the samples) of the `count` sequences at global stream positions [start, start + count)."""
        positions = torch.arange(start, start + count)
        epochs, offsets = positions // self.num_samples, positions % self.num_samples
        # A step may straddle an epoch boundary (G <= N, so at most two epochs).
        return torch.cat([self._permutation(int(e))[offsets[epochs == e]] for e in epochs.unique()])

    def indices_at(self, position: int) -> torch.Tensor:
        """Indices (into the samples) of the M sequences this replica takes of the step starting at `position`."""
        return self._indices(position + self.dp_rank * self.replica_batch_size, self.replica_batch_size)

    def global_tokens_at(self, position: int) -> int:
        """Label tokens of the whole global step starting at `position`, every replica's share included. Every replica
        knows the global order, so it counts them itself and the engine needs no collective for the loss scale (free for
        packed text; other formats read the other replicas' rows too)."""
        return int(self.samples.label_counts(self._indices(position, self.global_batch_size)).sum())

    def batch_at(self, position: int) -> list[MicroBatch]:
        """This replica's micro-batches of the step starting at global `position` (does not move the stream)."""
        input_ids, labels = self.samples.take(self.indices_at(position))
        b, tokens = len(input_ids) // self.n_microbatches, self.global_tokens_at(position)  # sequences per micro-batch
        return [MicroBatch(input_ids[i : i + b], labels[i : i + b], tokens) for i in range(0, len(input_ids), b)]

    def batch(self, step: int) -> list[MicroBatch]:
        """This replica's micro-batches of `step` counted from the start of the stream (random access)."""
        return self.batch_at(step * self.global_batch_size)

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        return self

    def __next__(self) -> list[MicroBatch]:
        micro_batches = self.batch_at(self.position)
        self.position += self.global_batch_size
        return micro_batches

    def state_dict(self) -> dict[str, int]:
        """The resume position in global samples consumed, and what it is a position in."""
        return {"samples_consumed": self.position, "num_samples": self.num_samples, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict()` position; valid for any layout, refused for other data or seed."""
        for key in ("num_samples", "seed"):
            if key in state and int(state[key]) != getattr(self, key):
                raise DataError(
                    f"the checkpoint's data position was taken over {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}; resume with the same data, train.seq_len and train.seed")
        position = state["samples_consumed"]
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:  # a position in this data
            raise DataError(f"the checkpoint's data position samples_consumed={position!r} is not a count of samples "
                            "(an integer >= 0); the checkpoint is corrupt: resume from another one")
        self.position = position
