"""Forward-only pipeline steps for evaluation: every micro-batch through every stage, in order, no backward."""

from __future__ import annotations

from .actions import Action, Kind, Schedule
from .partition import rank_stages
from .lowered import LoweredPipeline
from .lowering import lower


def forward_only(pipeline: LoweredPipeline, n_microbatches: int) -> Schedule:
    """Each rank runs F for its stages, micro-batch by micro-batch; lowered like any schedule.

    Feasible by construction: F(mb, s) depends only on F(mb, s-1), which every rank lists earlier in
    micro-batch order, so the lowering places the transfers without deadlock."""
    spec = pipeline.spec
    compute = [[Action(Kind.F, mb, s) for mb in range(n_microbatches)
                for s in rank_stages(r, spec.pp, spec.vpp, pipeline.placement)] for r in range(spec.pp)]
    return lower(compute, spec.pp, pipeline.n_stages, pipeline.placement)
