"""Lowering a pipeline before launch: linear work, one cached pipeline per spec, immutable, named faults."""

import random
import sys
from collections import Counter
from pathlib import Path

import pytest

import parallel.pipeline as pipeline_package
from parallel.pipeline.actions import Action, Kind
from parallel.pipeline.static_rules import ScheduleError
from parallel.pipeline.lowering import lower
from parallel.pipeline.lowered import lower_pipeline
from parallel.pipeline.schedules import SCHEDULES
from parallel.pipeline.simulate import Verified, check, peak_live, simulate, verify
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
    registered = SCHEDULES[name]
    vpp = registered.default_vpp
    n = pp * vpp
    compute = registered.generate(pp, m, vpp)
    lowered = lower(compute, pp, n, registered.placement)
    work = {"lower": lines_run(lambda: lower(compute, pp, n, registered.placement)),
            "verify": lines_run(lambda: verify(lowered, pp, n, m, registered.placement)),
            "simulate": lines_run(lambda: simulate(lowered, pp, n, m, registered.placement))}
    return sum(map(len, lowered)), work


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_lowering_does_work_linear_in_the_actions(name):
    # Twice the ranks and twice the micro-batches: four times the actions. Linear work grows four times; the
    # old round-robin replays and per-channel scans grew with ranks x actions (eight times and more here).
    small_actions, small = phases(name, 4, 16)
    big_actions, big = phases(name, 8, 32)
    growth = big_actions / small_actions
    assert 3.5 < growth < 4.5
    for phase in small:
        assert big[phase] / small[phase] < 1.15 * growth, (phase, small[phase], big[phase])


def test_lower_pipeline_is_cached_and_immutable():
    spec = PipelineSpec(pp=4, schedule="1f1b", n_microbatches=8)
    pipeline = lower_pipeline(spec, 8)
    assert lower_pipeline(PipelineSpec(pp=4, schedule="1f1b", n_microbatches=8), 8) is pipeline  # checked once
    assert lower_pipeline(spec, 12) is not pipeline  # another partition is another pipeline
    assert isinstance(pipeline.lowered, tuple) and all(isinstance(row, tuple) for row in pipeline.lowered)
    assert isinstance(pipeline.partition, tuple)
    with pytest.raises(TypeError):
        pipeline.lowered[0][0] = Action(Kind.F, 0, 0)  # callers cannot change the shared pipeline
    assert pipeline.simulate().makespan == 33  # 1F1B at pp=4, m=8: 3 * (m + pp - 1)


def test_an_edited_table_is_lowered_anew(tmp_path):
    path = dump_builtin("1f1b", 2, 4, tmp_path / "t.csv")
    spec = PipelineSpec(pp=2, schedule="table", n_microbatches=4, table_path=str(path))
    first = lower_pipeline(spec, 4)
    assert first.lowered == tuple(map(tuple, lower(SCHEDULES["1f1b"].generate(2, 4, 1), 2, 2, "loop")))
    dump_builtin("gpipe", 2, 4, path)  # same path, new content
    assert lower_pipeline(spec, 4).lowered != first.lowered


def test_peak_live_counts_micro_batches_or_weighs_stages():
    actions = [Action.parse(t) for t in "F0@s0 F1@s0 F0@s2 B0@s2 I1@s0 W1@s0 F2@s0 B0@s0 B2@s0".split()]
    assert peak_live(actions) == 3  # F0@s0, F1@s0, F0@s2 held at once; I frees nothing, W does
    layers = {0: 2, 2: 5}
    assert peak_live(actions, lambda stage: layers[stage]) == 9  # 2 + 2 + 5 layers' activations
    assert peak_live([]) == 0


def test_simulate_skips_only_the_check_that_verify_ran():
    spec, pp, m = SCHEDULES["interleaved-1f1b"], 4, 8
    lowered = lower(spec.generate(pp, m, 2), pp, 2 * pp, spec.placement)
    verified = verify(lowered, pp, 2 * pp, m, spec.placement)
    assert isinstance(verified, Verified) and verified == tuple(map(tuple, lowered))  # immutable, so still checked
    assert simulate(verified, pp, 2 * pp, m, spec.placement).end == simulate(lowered, pp, 2 * pp, m, spec.placement).end
    checked = lines_run(lambda: simulate(lowered, pp, 2 * pp, m, spec.placement))
    skipped = lines_run(lambda: simulate(verified, pp, 2 * pp, m, spec.placement))
    assert abs(checked - skipped - lines_run(lambda: check(lowered, pp, 2 * pp, m, spec.placement))) < 5
    with pytest.raises(ScheduleError, match="micro-batch 4 does not exist"):  # verified for m=8, not m=4
        simulate(verified, pp, 2 * pp, 4, spec.placement)


def mutate(lowered: list[list[Action]], rng: random.Random, m: int, n_stages: int) -> list[list[Action]]:
    """One random fault (or none): swap, drop, duplicate, move to another rank, renumber or re-kind an action."""
    out = [list(actions) for actions in lowered]
    r = rng.randrange(len(out))
    i, j = rng.randrange(len(out[r])), rng.randrange(len(out[r]))
    kind, mb, stage = out[r][i]
    match rng.randrange(6):
        case 0:
            out[r][i], out[r][j] = out[r][j], out[r][i]
        case 1:
            del out[r][i]
        case 2:
            out[r].insert(j, out[r][i])
        case 3:
            q = rng.randrange(len(out))
            out[q].insert(rng.randrange(len(out[q]) + 1), out[r].pop(i))
        case 4:
            out[r][i] = Action(kind, rng.randrange(m + 1), stage if rng.random() < 0.7 else rng.randrange(n_stages + 1))
        case _:
            out[r][i] = Action(rng.choice(list(Kind)), mb, stage)
    return out


def mutants(name: str, pp: int, m: int, count: int) -> list[tuple]:
    """`count` mutants of a registered schedule at (pp, m), as (lists, pp, n_stages, m, placement): drawn from an RNG
    seeded by the schedule's name and shape (a str seed goes through SHA-512, so it is the same in every process), so
    registering another schedule anywhere in SCHEDULES changes no other schedule's mutants."""
    registered, rng = SCHEDULES[name], random.Random(f"mutants {name} pp={pp} m={m}")
    n = pp * registered.default_vpp
    lowered = lower(registered.generate(pp, m, registered.default_vpp), pp, n, registered.placement)
    return [(mutate(lowered, rng, m, n), pp, n, m, registered.placement) for _ in range(count)]


def outcomes(schedule, pp: int, n: int, m: int, placement: str) -> list:
    """What verify and simulate say of a schedule: "verified" or the predicted end times, else the refusal."""
    answers = []
    for run in (lambda: verify(schedule, pp, n, m, placement), lambda: simulate(schedule, pp, n, m, placement)):
        try:
            answers.append(getattr(run(), "end", "verified"))
        except ScheduleError as err:
            answers.append(str(err))
    return answers


def test_random_faults_are_refused_with_the_action_named():
    # Swapped, dropped, duplicated, moved, renumbered and re-kinded actions: each schedule is either verified or
    # refused with one line naming rank, slot and action (or the deadlock), and simulate refuses it alike.
    cases = [case for name in SCHEDULES for pp, m in ((2, 4), (3, 3), (4, 8)) for case in mutants(name, pp, m, 25)]
    faults = 0
    for case in cases:
        verified, simulated = outcomes(*case)
        if verified != "verified":
            faults += 1
            assert verified.startswith(("rank ", "deadlock: ")) and "\n" not in verified, verified
            assert simulated == verified
        else:
            assert isinstance(simulated, list), simulated  # what verify passes, simulate times
    assert faults > len(cases) // 2  # most mutations are faults


def test_a_deadlock_is_named_alike_by_verify_and_simulate():
    # One model of waiting refuses for both: each stuck rank's first waiting op, and the peer's slot it waits for.
    rows = ["F0 F1 B0 F2 B1 B2", "F0 F1 F2 B0 B1 B2", "F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"]
    lowered = lower([[Action.parse(text, r) for text in row.split()] for r, row in enumerate(rows)], 4, 4, "loop")
    assert outcomes(lowered, 4, 4, 3, "loop") == [(
        "deadlock: rank 0, slot 4, RECV_B0@s0 waits for rank 1 to post SEND_B0@s1 (its slot 11); rank 1, slot 7, "
        "RECV_F2@s1 waits for rank 0 to post SEND_F2@s0 (its slot 7); rank 2, slot 10, RECV_F2@s2 waits for rank 1 "
        "to post SEND_F2@s1 (its slot 9); rank 3, slot 8, RECV_F2@s3 waits for rank 2 to post SEND_F2@s2 (its slot "
        "12)")] * 2
