"""Planning a pipeline: the one home of load -> partition -> lower -> verify, used by the engine, the
pre-launch check and `scripts/plan.py` alike."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.spec import PipelineSpec

from .actions import Costs, Schedule
from .partition import layer_partition
from .schedules import load_schedule, lower
from .simulate import SimResult, simulate, verify


@dataclass(frozen=True)
class PipelinePlan:
    """A checked pipeline: every rank's lowered action list, the stage placement and each stage's layers."""

    spec: PipelineSpec
    placement: str
    partition: tuple[range, ...]
    lowered: Schedule

    @property
    def n_stages(self) -> int:
        return self.spec.n_stages

    def simulate(self, costs: Costs | None = None) -> SimResult:
        """The predicted step under `costs` (unit costs by default)."""
        return simulate(self.lowered, self.spec.pp, self.n_stages, self.spec.n_microbatches, self.placement, costs)


def plan_pipeline(spec: PipelineSpec, num_layers: int) -> PipelinePlan:
    """Partition the layers, load the schedule, lower and verify it; raise ValueError naming the fix."""
    partition = tuple(layer_partition(num_layers, spec.n_stages,
                                      list(spec.layers_per_stage) if spec.layers_per_stage is not None else None))
    compute, placement = load_schedule(spec)
    lowered = lower(compute, spec.pp, spec.n_stages, placement)
    verify(lowered, spec.pp, spec.n_stages, spec.n_microbatches, placement)
    return PipelinePlan(spec, placement, partition, lowered)
