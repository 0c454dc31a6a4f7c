"""The pre-launch plan checks: linear work, one cached plan per pipeline, immutable plans, shared memory count."""

import sys
from collections import Counter
from pathlib import Path

import pytest

import parallel.pipeline as pipeline_package
from parallel.pipeline.actions import Action, Kind
from parallel.pipeline.lowering import lower
from parallel.pipeline.plan import plan_pipeline
from parallel.pipeline.schedules import SCHEDULES
from parallel.pipeline.simulate import peak_live, simulate, verify
from parallel.pipeline.tables import dump_builtin
from parallel.spec import PipelineSpec

PACKAGE = str(Path(pipeline_package.__file__).parent)


def lines_run(fn) -> int:
    """Python lines executed inside parallel/pipeline while fn() runs: a count of work that no load can skew."""
    count = Counter()

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None  # do not trace into other modules (their calls are C or constant work)
        if event == "line":
            count["lines"] += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count["lines"]


def phases(name: str, pp: int, m: int) -> tuple[int, dict[str, int]]:
    """Lowered actions, and lines run by lower, verify and simulate, for a built-in schedule."""
    spec = SCHEDULES[name]
    vpp = 2 if spec.needs_vpp else 1
    n = pp * vpp
    compute = spec.generate(pp, m, vpp)
    lowered = lower(compute, pp, n, spec.placement)
    work = {"lower": lines_run(lambda: lower(compute, pp, n, spec.placement)),
            "verify": lines_run(lambda: verify(lowered, pp, n, m, spec.placement)),
            "simulate": lines_run(lambda: simulate(lowered, pp, n, m, spec.placement))}
    return sum(map(len, lowered)), work


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_plan_checks_do_work_linear_in_the_actions(name):
    # Twice the ranks and twice the micro-batches: four times the actions. Linear work grows four times; the
    # old round-robin replays and per-channel scans grew with ranks x actions (eight times and more here).
    small_actions, small = phases(name, 4, 16)
    big_actions, big = phases(name, 8, 32)
    growth = big_actions / small_actions
    assert 3.5 < growth < 4.5
    for phase in small:
        assert big[phase] / small[phase] < 1.15 * growth, (phase, small[phase], big[phase])


def test_plan_pipeline_is_cached_and_immutable():
    spec = PipelineSpec(pp=4, schedule="1f1b", n_microbatches=8)
    plan = plan_pipeline(spec, 8)
    assert plan_pipeline(PipelineSpec(pp=4, schedule="1f1b", n_microbatches=8), 8) is plan  # checked once
    assert plan_pipeline(spec, 12) is not plan  # another partition is another plan
    assert isinstance(plan.lowered, tuple) and all(isinstance(row, tuple) for row in plan.lowered)
    assert isinstance(plan.partition, tuple)
    with pytest.raises(TypeError):
        plan.lowered[0][0] = Action(Kind.F, 0, 0)  # callers cannot change the shared plan
    assert plan.simulate().makespan == 33  # 1F1B at pp=4, m=8: 3 * (m + pp - 1)


def test_an_edited_table_is_planned_anew(tmp_path):
    path = dump_builtin("1f1b", 2, 4, tmp_path / "t.csv")
    spec = PipelineSpec(pp=2, schedule="table", n_microbatches=4, table_path=str(path))
    first = plan_pipeline(spec, 4)
    assert first.lowered == tuple(map(tuple, lower(SCHEDULES["1f1b"].generate(2, 4, 1), 2, 2, "loop")))
    dump_builtin("gpipe", 2, 4, path)  # same path, new content
    assert plan_pipeline(spec, 4).lowered != first.lowered


def test_peak_live_counts_micro_batches_or_weighs_stages():
    actions = [Action.parse(t) for t in "F0@s0 F1@s0 F0@s2 B0@s2 I1@s0 W1@s0 F2@s0 B0@s0 B2@s0".split()]
    assert peak_live(actions) == 3  # F0@s0, F1@s0, F0@s2 held at once; I frees nothing, W does
    layers = {0: 2, 2: 5}
    assert peak_live(actions, lambda stage: layers[stage]) == 9  # 2 + 2 + 5 layers' activations
    assert peak_live([]) == 0
