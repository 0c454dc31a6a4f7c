"""Lowering a pipeline: the one home of load -> partition -> lower -> verify, used by the engine, the
pre-launch check and `scripts/preview.py` alike, and run once per (schedule, pp, vpp, m, partition)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from parallel.spec import PipelineSpec

from .actions import Action, Costs, Schedule
from .collector import collector_paused
from .lowering import lower
from .partition import layer_partition
from .schedules import RegisteredSchedule, find_schedule
from .simulate import SimResult, predict, verify
from .tables import load_table


@dataclass(frozen=True)
class LoweredPipeline:
    """A checked pipeline: every rank's lowered action list, the stage placement and each stage's layers.

    Lowered pipelines are cached and shared, so everything in one is immutable (tuples)."""

    spec: PipelineSpec
    placement: str
    partition: tuple[range, ...]
    lowered: tuple[tuple[Action, ...], ...]

    @property
    def n_stages(self) -> int:
        return self.spec.n_stages

    def simulate(self, costs: Costs | None = None) -> SimResult:
        """The predicted step under `costs` (unit costs by default)."""
        return predict(self.lowered, self.spec.pp, self.n_stages, self.placement, costs)


def load_schedule(spec: PipelineSpec) -> tuple[Schedule, str]:
    """Compute lists and placement of a pipeline spec: a schedule checked against its registry entry, or a table."""
    if spec.schedule == "table":
        if not spec.table_path or spec.table_path == "???":
            raise ValueError("schedule=table needs schedule.path=<a .csv or .json schedule table>")
        compute, meta = load_table(spec.table_path, pp=spec.pp, n_microbatches=spec.n_microbatches, vpp=spec.vpp)
        return compute, meta.placement
    registered = find_schedule(spec.schedule)
    registered.check(spec.schedule, spec.pp, spec.n_microbatches, spec.vpp)
    return registered.generate(spec.pp, spec.n_microbatches, spec.vpp), registered.placement


def lower_pipeline(spec: PipelineSpec, num_layers: int) -> LoweredPipeline:
    """Partition the layers, load the schedule, lower and verify it; raise ValueError naming the fix.

    Cached: every caller in a process (validation, each emulated rank, the engine) shares one pipeline. The key
    holds what the schedule is made from, so a re-registered schedule or an edited table file is lowered anew."""
    table = spec.schedule == "table"
    source: RegisteredSchedule | tuple[int, int] | None = None if table else find_schedule(spec.schedule)
    if table and spec.table_path and os.path.isfile(spec.table_path):
        stat = os.stat(spec.table_path)
        source = (stat.st_mtime_ns, stat.st_size)
    return _lower(spec, num_layers, source)


@functools.lru_cache(maxsize=16)
@collector_paused
def _lower(spec: PipelineSpec, num_layers: int, source: object) -> LoweredPipeline:
    """`lower_pipeline` for one cache key (`source`: the registered schedule or the table file's stamp)."""
    del source  # part of the cache key only
    counts = list(spec.layers_per_stage) if spec.layers_per_stage is not None else None
    partition = tuple(layer_partition(num_layers, spec.n_stages, counts))
    compute, placement = load_schedule(spec)
    lowered = lower(compute, spec.pp, spec.n_stages, placement)
    checked = verify(lowered, spec.pp, spec.n_stages, spec.n_microbatches, placement)  # rank lists as tuples
    return LoweredPipeline(spec, placement, partition, checked)
