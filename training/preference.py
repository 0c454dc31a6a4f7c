"""DPO's reference log-probabilities: computed once per pair, before the first step, by forward-only passes of the
engine on its starting weights (the frozen reference: `checkpoint.load_dense`, or the seeded initialisation), then
carried by every micro-batch that reads the pair.

Why once and cached rather than a reference forward in every step: the reference never changes, so a second model
(its memory on every rank, and its forward in every step of every epoch) would recompute the same numbers. The
pass costs one forward per pair a run reads, about a third of a training step's compute per pair (a forward of the
forward + backward), paid once before the first step; the cache costs 16 bytes per pair on every rank. The pairs are
split over the DP replicas (each computes its share of every global batch) and gathered, so each is computed once.
"""

from __future__ import annotations

import logging
import time

import torch

from parallel.collectives import all_gather_cat
from parallel.grid import ParallelGrid
from parallel.step import Engine, MicroBatch
from training.data.pairs import PairBatches, attach_reference

log = logging.getLogger("sluice")


def reference_table(engine: Engine, stream: PairBatches, steps: int, grid: ParallelGrid) -> torch.Tensor:
    """[pairs, 2] float64: the summed label log-probability of each pair's chosen and rejected conversation under the
    engine's current (starting) weights, for every pair the first `steps` steps read (NaN for the others).

    The pairs go through in ascending order, one global batch of them per forward-only pass (the last one padded
    with copies of its last pair, whose values are dropped): replica d takes its share as in a training step."""
    needed = stream.pairs_read(steps)
    per_step, per_replica = stream.global_batch_size, stream.replica_batch_size
    order = torch.cat([needed, needed[-1:].repeat((-len(needed)) % per_step)])
    table = torch.full((stream.num_samples, 2), float("nan"), dtype=torch.float64)
    for start in range(0, len(order), per_step):
        chunk = order[start:start + per_step]
        input_ids, labels = stream.samples.take(chunk[grid.dp_rank * per_replica:(grid.dp_rank + 1) * per_replica])
        rows = len(input_ids) // stream.n_microbatches
        micro_batches = [MicroBatch(input_ids[i:i + rows], labels[i:i + rows]) for i in range(0, len(input_ids), rows)]
        logps = engine.sequence_logps(micro_batches).to(grid.device)
        every = all_gather_cat(logps, grid.dp_group, dim=0).cpu().view(per_step, 2)  # replicas in DP-rank order
        real = min(per_step, len(needed) - start)
        table[chunk[:real]] = every[:real]
    return table


def prepare_reference(engine: Engine, stream: PairBatches, val_batches: list[list[MicroBatch]] | None, steps: int,
                      grid: ParallelGrid) -> float:
    """Give the training stream and the held-out micro-batches their reference log-probabilities, before any step
    changes the weights; return the seconds it took (logged on global rank 0)."""
    start = time.perf_counter()
    stream.reference = reference_table(engine, stream, steps, grid)
    for micro_batches in val_batches or []:
        attach_reference(micro_batches, engine.sequence_logps(micro_batches))
    seconds = time.perf_counter() - start
    if grid.rank == 0:
        pairs = int((~torch.isnan(stream.reference[:, 0])).sum())
        held_out = sum(mb.input_ids.shape[0] // 2 for step in val_batches or [] for mb in step) * grid.dp
        log.info("dpo: reference log-probabilities of %d training and %d held-out pairs (forward only, starting "
                 "weights) in %.1f s", pairs, held_out, seconds)
    return seconds
