"""DPO's reference log-probabilities: computed once per pair, before the first step, by forward-only passes of the
engine on its starting weights (the frozen reference: `checkpoint.load_dense`, or the seeded initialisation), then
carried by every micro-batch that reads the pair.

The pass is the engine's generic forward-only pass (`Engine.forward_sums`), its objective's sums the rows' values.

Why once and cached rather than a reference forward in every step: the reference never changes, so a second model
(its memory on every rank, and its forward in every step of every epoch) would recompute the same numbers. The
pass costs one forward per pair a run reads, about a third of a training step's compute per pair (a forward of the
forward + backward), paid once before the first step; the cache costs 16 bytes per pair on every rank. The pairs are
split over the DP replicas (each computes its share of every global batch) and gathered, so each is computed once.
"""

import itertools
import logging
import time
from dataclasses import dataclass, replace

import torch

from parallel.collectives import all_gather_cat
from parallel.grid import ParallelGrid
from parallel.step import Engine, MicroBatch, TokenLoss
from training.data.pairs import PairBatches, attach_reference
from training.objectives.lm import sequence_logps

log = logging.getLogger("sluice")
ROW = "row"  # the payload key: each row's place among the pass's rows [B] long


class RowTable:
    """What every forward-only pass's objective shares: it counts rows and logs nothing (its sums are a table)."""

    def count(self, micro_batch: MicroBatch) -> torch.Tensor:
        return torch.tensor(micro_batch.labels.shape[0])

    def metrics(self, sums: list[float], count: int) -> dict[str, float]:
        return {}


def placed_rows(micro_batches: list[MicroBatch]) -> tuple[list[MicroBatch], int]:
    """The micro-batches with each row's place among all their rows in the payload (`ROW`), and the rows in all."""
    ends = list(itertools.accumulate(len(mb.input_ids) for mb in micro_batches))
    return [replace(mb, extra={**mb.extra, ROW: torch.arange(end - len(mb.input_ids), end)})
            for mb, end in zip(micro_batches, ends)], ends[-1]


@dataclass(frozen=True)
class RowLogps(RowTable):
    """The reference pass's objective: no loss; its sums are each row's summed label log-probability at the row's
    place (`extra[ROW]`) among the pass's `width` rows, zero elsewhere, so adding them up keeps every value exact."""

    width: int

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor],
                 token_loss: TokenLoss) -> tuple[torch.Tensor, torch.Tensor]:
        logps = sequence_logps(logits, labels, token_loss).double()
        rows = torch.zeros(self.width, dtype=torch.float64, device=logps.device)
        return logps.sum(), rows.index_copy_(0, extra[ROW].to(logps.device), logps)


def row_logps(engine: Engine, micro_batches: list[MicroBatch]) -> torch.Tensor:
    """Each row's summed label log-probability under the engine's current weights, forward only, the micro-batches'
    rows in order (this DP replica's; float64 on the device, on every rank)."""
    placed, rows = placed_rows(micro_batches)
    return engine.forward_sums(placed, RowLogps(rows))


def reference_table(engine: Engine, stream: PairBatches, steps: int, grid: ParallelGrid) -> torch.Tensor:
    """[pairs, 2] float64: the summed label log-probability of each pair's chosen and rejected conversation under the
    engine's current (starting) weights, for every pair the first `steps` steps read (NaN for the others). The pairs go
    through in ascending order, one global batch of them per forward-only pass (the last one padded with copies of its
    last pair, whose values are dropped): replica d takes its share as in a training step."""
    needed = stream.pairs_read(steps)
    per_step, per_replica = stream.global_batch_size, stream.replica_batch_size
    order = torch.cat([needed, needed[-1:].repeat((-len(needed)) % per_step)])
    table = torch.full((stream.num_samples, 2), float("nan"), dtype=torch.float64)
    for start in range(0, len(order), per_step):
        batch = order[start:start + per_step]
        input_ids, labels = stream.samples.take(batch[grid.dp_rank * per_replica:(grid.dp_rank + 1) * per_replica])
        rows = len(input_ids) // stream.n_microbatches
        micro_batches = [MicroBatch(input_ids[i:i + rows], labels[i:i + rows]) for i in range(0, len(input_ids), rows)]
        logps = row_logps(engine, micro_batches)
        every = all_gather_cat(logps, grid.dp_group, dim=0).cpu().view(per_step, 2)  # replicas in DP-rank order
        real = min(per_step, len(needed) - start)
        table[batch[:real]] = every[:real]
    return table


def compute_reference(engine: Engine, stream: PairBatches, val_batches: list[list[MicroBatch]] | None, steps: int,
                      grid: ParallelGrid) -> float:
    """Give the training stream and the held-out micro-batches their reference log-probabilities, before any step
    changes the weights; return the seconds it took (logged on global rank 0)."""
    start = time.perf_counter()
    stream.reference = reference_table(engine, stream, steps, grid)
    for micro_batches in val_batches or []:
        attach_reference(micro_batches, row_logps(engine, micro_batches).cpu())
    seconds = time.perf_counter() - start
    if grid.rank == 0:
        pairs = int((~torch.isnan(stream.reference[:, 0])).sum())
        held_out = sum(mb.input_ids.shape[0] // 2 for step in val_batches or [] for mb in step) * grid.dp
        log.info("dpo: reference log-probabilities of %d training and %d held-out pairs (forward only, starting "
                 "weights) in %.1f s", pairs, held_out, seconds)
    return seconds
