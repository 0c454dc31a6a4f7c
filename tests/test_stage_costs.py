"""Per-stage and per-boundary durations in the simulator (`Costs.stage_*`), against unit costs and by hand."""

import pytest

from parallel.pipeline.actions import Costs, Kind
from parallel.pipeline.lowering import lower
from parallel.pipeline.schedules import SCHEDULES
from parallel.pipeline.simulate import simulate


def run(name: str, pp: int, m: int, costs: Costs):
    registered = SCHEDULES[name]
    vpp = registered.default_vpp
    lowered = lower(registered.generate(pp, m, vpp), pp, pp * vpp, registered.placement)
    return simulate(lowered, pp, pp * vpp, m, registered.placement, costs)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_uniform_per_stage_costs_replay_as_the_scalars(name):
    pp, m = 4, 8
    n = pp * SCHEDULES[name].default_vpp
    scalar = Costs(f=1, b=2, i=1, w=1, comm=0.25)
    staged = Costs(f=9, b=9, i=9, w=9, comm=9, stage_f=(1.0,) * n, stage_b=(2.0,) * n, stage_i=(1.0,) * n,
                   stage_w=(1.0,) * n, stage_comm=(0.25,) * (n - 1))
    a, b = run(name, pp, m, scalar), run(name, pp, m, staged)
    assert (a.start, a.end, a.busy, a.makespan) == (b.start, b.end, b.busy, b.makespan)


def test_a_slow_last_stage_sets_the_pace_of_1f1b():
    # Stage 1 runs F and B back to back (6 per micro-batch) after stage 0's first F (1) and before its last B (2).
    res = run("1f1b", 2, 4, Costs(stage_f=(1, 2), stage_b=(2, 4)))
    assert res.makespan == pytest.approx(1 + 4 * 6 + 2)
    assert res.busy == pytest.approx([4 * 3, 4 * 6])


def test_boundary_comm_is_charged_per_boundary():
    free = run("1f1b", 3, 6, Costs())
    first = run("1f1b", 3, 6, Costs(stage_comm=(1.0, 0.0)))
    both = run("1f1b", 3, 6, Costs(stage_comm=(1.0, 1.0)))
    assert free.makespan < first.makespan < both.makespan
    assert both.makespan == pytest.approx(run("1f1b", 3, 6, Costs(comm=1.0)).makespan)


def test_costs_of_and_lookup_errors():
    costs = Costs(stage_f=(1.0, 3.0))
    assert costs.of(Kind.F, 1) == 3.0 and costs.of(Kind.F) == 1.0 and costs.of(Kind.B, 1) == 2.0
    assert Costs().of(Kind.W, 5) == 1.0
    with pytest.raises(ValueError, match="2 per-stage F durations for 3 stages"):
        costs.stage_durations(3)
    with pytest.raises(ValueError, match="1 boundary comm times for 3 stages"):
        Costs(stage_comm=(1.0,)).boundary_comm(3)
