"""Schedules as data: generators, lowering, the pre-launch checker and the simulator (pure Python, fast)."""

import random

import pytest

from parallel.pipeline.actions import Action, Costs, Kind, Schedule
from parallel.pipeline.partition import rank_stages, stage_to_rank
from parallel.pipeline.actions import comm_peer, counterpart, needs, output_of
from parallel.pipeline.lowering import lower
from parallel.pipeline.render import step_text
from parallel.pipeline.lowered import load_schedule
from parallel.pipeline.schedules import (SCHEDULES, RegisteredSchedule, find_schedule, gpipe, interleaved_1f1b,
                                         one_f_one_b, zb_h1, zbv)
from parallel.spec import PipelineSpec
from parallel.pipeline.simulate import ScheduleError, simulate, verify

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


def parse(*rows: str) -> Schedule:
    """One string per rank, e.g. 'F0 SEND_F0 RECV_B0@s0'; a bare action runs on stage = rank."""
    return [[Action.parse(tok, stage=r) for tok in row.split()] for r, row in enumerate(rows)]


def text(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, actions)) for actions in schedule]


def built(name: str, pp: int, m: int, costs: Costs | None = None) -> Schedule:
    registered = SCHEDULES[name]
    vpp = registered.default_vpp
    return lower(registered.generate(pp, m, vpp), pp, pp * vpp, registered.placement, costs)


def vpps(name: str, pp: int) -> list[int]:
    """Chunks per rank worth checking: the default, and one more where the schedule takes it (small pp only)."""
    least, most = SCHEDULES[name].vpp
    return [v for v in (least, least + 1) if (most is None or v <= most) and (v == least or pp <= 4)]


def shapes(name: str, pp: int) -> list[int]:
    """Micro-batch counts worth checking at pp: the edges around pp and 2pp, and 16 (as constraints allow)."""
    if SCHEDULES[name].microbatches_multiple_of_pp:
        return sorted({pp, 2 * pp, 16 // pp * pp})
    return sorted({1, 2, 3, pp - 1, pp, pp + 1, 2 * pp - 1, 2 * pp, 16} - {0})


# --- Actions. -------------------------------------------------------------------------------------------


def test_action_str_and_parse_round_trip():
    for kind in Kind:
        a = Action(kind, 12, 3)
        assert Action.parse(str(a)) == a
    assert str(Action(F, 3, 1)) == "F3@s1"
    assert Action.parse("SEND_F3", stage=1) == Action(Kind.SEND_F, 3, 1)
    assert Action.parse(" B0@s2 ", stage=5) == Action(B, 0, 2)  # an explicit stage wins
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("X3@s1")
    with pytest.raises(ValueError, match="names no stage"):
        Action.parse("F3")
    assert Kind.RECV_B.is_comm and not Kind.W.is_comm


# --- Generators and lowering. ---------------------------------------------------------------------------


def test_generators_emit_compute_in_the_documented_order():
    assert text(gpipe(2, 3)) == ["F0@s0 F1@s0 F2@s0 B0@s0 B1@s0 B2@s0", "F0@s1 F1@s1 F2@s1 B0@s1 B1@s1 B2@s1"]
    assert text(one_f_one_b(3, 4)) == [
        "F0@s0 F1@s0 F2@s0 B0@s0 F3@s0 B1@s0 B2@s0 B3@s0",
        "F0@s1 F1@s1 B0@s1 F2@s1 B1@s1 F3@s1 B2@s1 B3@s1",
        "F0@s2 B0@s2 F1@s2 B1@s2 F2@s2 B2@s2 F3@s2 B3@s2",
    ]
    assert all(not a.kind.is_comm for row in one_f_one_b(4, 8) for a in row)
    assert SCHEDULES["1f1b"].placement == "loop" and SCHEDULES["gpipe"].vpp == (1, 1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedules_verify_for_all_small_shapes(name):
    for pp in range(1, 9):
        for m in range(1, 17):
            verify(built(name, pp, m), pp, pp, m, "loop")


def test_lowered_1f1b_pairs_send_and_recv_into_one_batch():
    rows = text(built("1f1b", 4, 8))
    # Steady state, as in Megatron: after a forward, send it and receive the next gradient in one batch;
    # the peer below pairs the gradient it sends with the activation it receives.
    assert "F5@s1 SEND_F5@s1 RECV_B3@s1 B3@s1 SEND_B3@s1 RECV_F6@s1 F6@s1" in rows[1]
    assert "B3@s2 SEND_B3@s2 RECV_F5@s2 F5@s2 SEND_F5@s2 RECV_B4@s2 B4@s2" in rows[2]
    assert rows[3].startswith("RECV_F0@s3 F0@s3")  # the last stage sends no activation
    assert "SEND_B" not in rows[0] and "RECV_F" not in rows[0]


def test_lowering_sends_after_producer_and_receives_before_consumer():
    for pp, m in [(2, 4), (4, 8), (5, 5)]:
        for name, registered in SCHEDULES.items():
            n = pp * registered.default_vpp
            for rank, actions in enumerate(built(name, pp, m)):
                for k, a in enumerate(actions):
                    if a.kind in (Kind.SEND_F, Kind.SEND_B):
                        sent = (output_of(b, n) for b in actions[:k] if not b.kind.is_comm)
                        assert any(r is not None and counterpart(Action._make(r)) == a for r in sent), (name, rank, k, a)
                    need = None if a.kind.is_comm else needs(a, n)
                    if need is not None and comm_peer(need, n, registered.placement, pp) != rank:
                        assert need in actions[:k], (name, rank, k, a)


def test_comm_peer():
    assert comm_peer(Action(Kind.SEND_F, 0, 1), 4, "loop", 4) == 2
    assert comm_peer(Action(Kind.RECV_F, 0, 1), 4, "loop", 4) == 0
    assert comm_peer(Action(Kind.SEND_B, 0, 4), 8, "loop", 4) == 3  # chunk 1 of rank 0 -> chunk 0 of rank 3
    assert comm_peer(Action(Kind.RECV_B, 0, 2), 4, "v", 2) == 0  # stage 3 sits on rank 0 under V
    with pytest.raises(ValueError, match="compute action"):
        comm_peer(Action(F, 0, 1), 4, "loop", 4)


# --- Interleaved 1F1B, ZB-H1, ZB-V. --------------------------------------------------------------------


def test_new_generators_emit_compute_in_the_documented_order():
    # Interleaved: a group of pp micro-batches goes through chunk 0, then chunk 1; backwards last chunk first.
    assert text(interleaved_1f1b(2, 4, 2)) == [
        "F0@s0 F1@s0 F0@s2 F1@s2 F2@s0 B0@s2 F3@s0 B1@s2 F2@s2 B0@s0 F3@s2 B1@s0 B2@s2 B3@s2 B2@s0 B3@s0",
        "F0@s1 F1@s1 F0@s3 B0@s3 F1@s3 B1@s3 F2@s1 B0@s1 F3@s1 B1@s1 F2@s3 B2@s3 F3@s3 B3@s3 B2@s1 B3@s1",
    ]
    # ZB-H1: 1F1B with B split into I then W; rank r holds r of its W's back to the end.
    assert text(zb_h1(3, 4)) == [
        "F0@s0 F1@s0 F2@s0 I0@s0 W0@s0 F3@s0 I1@s0 W1@s0 I2@s0 W2@s0 I3@s0 W3@s0",
        "F0@s1 F1@s1 I0@s1 F2@s1 I1@s1 W0@s1 F3@s1 I2@s1 W1@s1 I3@s1 W2@s1 W3@s1",
        "F0@s2 I0@s2 F1@s2 I1@s2 F2@s2 I2@s2 W0@s2 F3@s2 I3@s2 W1@s2 W2@s2 W3@s2",
    ]
    # ZB-V: rank 0 holds the first and the last stage, rank 1 the two middle ones (the V).
    assert text(zbv(2, 3)) == [
        "F0@s0 F1@s0 F2@s0 F0@s3 I0@s3 W0@s3 F1@s3 I1@s3 W1@s3 I0@s0 W0@s0 F2@s3 I2@s3 W2@s3 I1@s0 W1@s0 I2@s0 W2@s0",
        "F0@s1 F0@s2 F1@s1 F1@s2 I0@s2 W0@s2 F2@s1 I0@s1 W0@s1 F2@s2 I1@s2 W1@s2 I1@s1 I2@s2 I2@s1 W1@s1 W2@s2 W2@s1",
    ]
    assert (SCHEDULES["interleaved-1f1b"].vpp, SCHEDULES["interleaved-1f1b"].placement) == ((2, None), "loop")
    assert (SCHEDULES["zbv"].vpp, SCHEDULES["zbv"].placement) == ((2, 2), "v")
    assert (SCHEDULES["zb-h1"].vpp, SCHEDULES["zb-h1"].placement) == ((1, 1), "loop")


@pytest.mark.parametrize("name, pp, m, vpp, message", [
    ("interleaved-1f1b", 4, 6, 2, "schedule 'interleaved-1f1b' needs schedule.n_microbatches to be a multiple of "
                                  "parallel.pp (got 6 and 4); set schedule.n_microbatches=8"),
    ("interleaved-1f1b", 4, 8, 1, "schedule 'interleaved-1f1b' runs 2 or more stages per rank; set parallel.vpp>=2 "
                                  "(got 1)"),
    ("zbv", 4, 8, 3, "schedule 'zbv' runs 2 stages per rank; set parallel.vpp=2 (got 3)"),
    ("zb-h1", 4, 8, 2, "schedule 'zb-h1' runs 1 stage per rank; set parallel.vpp=1 (got 2)"),
])
def test_the_registry_refuses_layouts_a_schedule_cannot_run(name, pp, m, vpp, message):
    with pytest.raises(ValueError) as refused:
        load_schedule(PipelineSpec(pp=pp, vpp=vpp, schedule=name, n_microbatches=m))
    assert str(refused.value) == message
    bounded = RegisteredSchedule(gpipe, vpp=(1, 3))
    with pytest.raises(ValueError, match=r"^schedule 'x' runs 1 to 3 stages per rank; set parallel.vpp<=3 \(got 4\)$"):
        bounded.check("x", 2, 4, 4)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_verifies_with_and_without_comm_costs(name):
    registered = SCHEDULES[name]
    for pp in range(2, 9):
        for vpp in vpps(name, pp):
            for m in shapes(name, pp):
                compute = registered.generate(pp, m, vpp)
                for costs in (Costs(), Costs(f=1, b=2, i=1, w=1, comm=0.5)):
                    lowered = lower(compute, pp, pp * vpp, registered.placement, costs)
                    verify(lowered, pp, pp * vpp, m, registered.placement)


# --- Simulation. ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_and_peak_memory_match_the_textbook(name):
    for pp in range(1, 9):
        for m in range(1, 17):
            res = simulate(built(name, pp, m), pp, pp, m, "loop", Costs(f=1.0, b=2.0, comm=0.0))
            assert res.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1)), (pp, m)
            assert res.makespan == pytest.approx(3.0 * (m + pp - 1))
            expected = [m] * pp if name == "gpipe" else [min(pp - r, m) for r in range(pp)]
            assert res.peak_live == expected, (pp, m)


def test_interleaved_bubble_matches_the_textbook():
    # Each chunk is 1/v of a stage, so F and B of a chunk cost 1/v of a full stage's (F=1, B=2).
    for pp in range(2, 9):
        for v in (2, 3):
            for m in range(pp, 17, pp):
                costs = Costs(f=1 / v, b=2 / v)
                compute = interleaved_1f1b(pp, m, v)
                res = simulate(lower(compute, pp, pp * v, "loop", costs), pp, pp * v, m, "loop", costs)
                assert res.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1)), (pp, v, m)


def test_zero_bubble_h1_beats_1f1b_at_equal_peak_memory():
    costs = Costs(f=1, b=2, i=1, w=1)  # B = I + W, so both do the same work
    for pp in range(2, 9):
        for m in range(1, 17):
            zb = simulate(built("zb-h1", pp, m, costs), pp, pp, m, "loop", costs)
            base = simulate(built("1f1b", pp, m, costs), pp, pp, m, "loop", costs)
            assert zb.bubble_fraction < base.bubble_fraction, (pp, m)
            # Peak memory of the pipeline (its fullest rank) is 1F1B's: min(pp, m) micro-batches. Deferring W's
            # moves later ranks up to that level, which is what lets them fill their bubbles.
            assert max(zb.peak_live) == max(base.peak_live) == min(pp, m), (pp, m)
            assert base.peak_live == [min(pp - r, m) for r in range(pp)]
            if m >= pp:  # a third of 1F1B's bubble: (p-1) instead of 3(p-1) units per rank
                assert zb.makespan == pytest.approx(3 * m + pp - 1)
                assert zb.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1))


def test_zero_bubble_v_bubble_and_memory():
    costs = Costs(f=1, b=2, i=1, w=1)  # per chunk, i.e. half of a stage of the same model under 1F1B
    for pp in range(2, 9):
        for m in (pp, 2 * pp, 16):
            res = simulate(built("zbv", pp, m, costs), pp, 2 * pp, m, "v", costs)
            # Two chunks of half a stage each: 2*min(pp, m) chunk activations = 1F1B's peak of min(pp, m) stages.
            assert max(res.peak_live) == 2 * min(pp, m), (pp, m)
            if m >= 2 * pp:  # only the start-up ramp is left
                assert res.bubble_fraction == pytest.approx((pp - 1) / (6 * m + pp - 1)), (pp, m)


def test_comm_cost_stretches_the_step():
    fast = simulate(built("1f1b", 4, 8), 4, 4, 8, "loop", Costs())
    slow = simulate(built("1f1b", 4, 8), 4, 4, 8, "loop", Costs(comm=0.5))
    assert slow.makespan > fast.makespan and slow.busy == fast.busy


def test_step_text_draws_a_grid():
    out = step_text(built("1f1b", 2, 3), 2, 2, 3, "loop")
    lines = out.splitlines()
    assert lines[1] == "rank 0  | F0 F1 .  .  B0 -- F2 B1 -- .  B2 --"
    assert lines[2] == "rank 1  | .  F0 B0 -- F1 B1 -- F2 B2 -- .  ."  # idle at the end is bubble too
    assert "bubble" in lines[-1] and "[2, 1]" in lines[-1]


# --- General over chunks, placements and the I/W split (the shapes later schedules will use). -----------


def chunked(pp: int, m: int, vpp: int, placement: str, split: bool = False) -> Schedule:
    """A looped GPipe over every chunk of a rank: all forwards by stage, then all backwards in reverse."""
    sched = []
    for r in range(pp):
        stages = rank_stages(r, pp, vpp, placement)
        acts = [Action(F, i, s) for s in stages for i in range(m)]
        for s in reversed(stages):
            acts += [Action(k, i, s) for i in range(m) for k in ((I, W) if split else (B,))]
        sched.append(acts)
    return sched


@pytest.mark.parametrize("placement,vpp", [("loop", 2), ("loop", 3), ("v", 2)])
def test_multi_chunk_schedules_lower_and_verify(placement, vpp):
    for pp in (1, 2, 3, 4):
        for split in (False, True):
            lowered = lower(chunked(pp, 4, vpp, placement, split), pp, pp * vpp, placement)
            verify(lowered, pp, pp * vpp, 4, placement)
            res = simulate(lowered, pp, pp * vpp, 4, placement)
            assert res.peak_live == [4 * vpp] * pp  # every chunk keeps all micro-batches until its W/B


def test_v_placement_hands_over_locally():
    pp = 2  # rank 0: stages 0 and 3, rank 1: stages 1 and 2 -> the 1->2 hand-over never leaves rank 1
    lowered = lower(chunked(pp, 2, 2, "v"), pp, 4, "v")
    assert not any(a.kind.is_comm and a.stage in (1, 2) and comm_peer(a, 4, "v", pp) == 1 for a in lowered[1])
    assert "SEND_F0@s1" not in text(lowered)[1] and "SEND_B0@s2" not in text(lowered)[1]
    assert "SEND_F0@s2" in text(lowered)[1]  # 2 -> 3 goes back to rank 0


def random_feasible(rng: random.Random, pp: int, m: int, vpp: int, placement: str, split: bool) -> Schedule:
    """Per-rank compute lists read off one random global order that respects every data dependency."""
    n = pp * vpp
    todo = {(r, Action(k, i, s)) for r in range(pp) for s in rank_stages(r, pp, vpp, placement)
            for i in range(m) for k in ((F, I, W) if split else (F, B))}
    done, sched = set(), [[] for _ in range(pp)]

    def ready(a: Action) -> bool:
        mb, s = a.microbatch, a.stage
        if a.kind is F:
            return s == 0 or Action(F, mb, s - 1) in done
        if a.kind is W:
            return Action(I, mb, s) in done
        upstream = s == n - 1 or Action(B, mb, s + 1) in done or Action(I, mb, s + 1) in done
        return Action(F, mb, s) in done and upstream

    while todo:
        r, a = rng.choice(sorted((x for x in todo if ready(x[1])), key=str))
        todo.remove((r, a))
        done.add(a)
        sched[r].append(a)
    return sched


def test_lowering_never_deadlocks_a_feasible_schedule():
    rng = random.Random(0)
    for trial in range(300):
        pp, m = rng.randint(1, 4), rng.randint(1, 5)
        placement, vpp = rng.choice([("loop", 1), ("loop", 2), ("loop", 3), ("v", 2)])
        split = rng.random() < 0.5
        compute = random_feasible(rng, pp, m, vpp, placement, split)
        costs = Costs(f=rng.uniform(0.5, 2), b=rng.uniform(0.5, 3), i=rng.uniform(0.5, 2), w=rng.uniform(0.5, 2))
        lowered = lower(compute, pp, pp * vpp, placement, costs)
        verify(lowered, pp, pp * vpp, m, placement)
        simulate(lowered, pp, pp * vpp, m, placement, costs)


# --- Broken schedules: each refused before launch with rank, slot and action named. ---------------------


def refuse(schedule: Schedule, *fragments: str, m: int = 2, placement: str = "loop", n_stages: int = 0) -> str:
    pp = len(schedule)
    with pytest.raises(ScheduleError) as err:
        verify(schedule, pp, n_stages or pp, m, placement)
    msg = str(err.value)
    for fragment in fragments:
        assert fragment in msg, msg
    assert "\n" not in msg
    return msg


def test_refuses_deadlock_from_swapped_compute():
    # Rank 1 runs F1 before B0, but rank 0 only makes F1 after B0's gradient came back: a cycle.
    lowered = lower(parse("F0 B0 F1 B1", "F0 F1 B0 B1"), 2, 2, "loop")
    refuse(lowered, "deadlock", "rank 0, slot 2, RECV_B0@s0 waits for rank 1",
           "rank 1, slot 2, RECV_F1@s1 waits for rank 0 to post SEND_F1@s0 (its slot 5)")


def test_refuses_deadlock_from_a_deferred_send():
    good = parse("F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1", "RECV_F0@s1 F0 RECV_F1@s1 F1 B0 SEND_B0 B1 SEND_B1")
    verify(good, 2, 2, 2, "loop")
    # Swap SEND_F1 with (RECV_B0 B0): rank 0 now wants B0's gradient before rank 1 can even run F1.
    bad = parse("F0 SEND_F0 F1 RECV_B0 B0 SEND_F1 RECV_B1 B1", "RECV_F0@s1 F0 RECV_F1@s1 F1 B0 SEND_B0 B1 SEND_B1")
    refuse(bad, "deadlock", "rank 0, slot 3, RECV_B0@s0", "rank 1, slot 2, RECV_F1@s1 waits for rank 0")


def test_refuses_missing_backward():
    lowered = built("1f1b", 2, 3)
    lowered[1] = [a for a in lowered[1] if str(a) not in ("B1@s1", "SEND_B1@s1")]
    refuse(lowered, "rank 1, slot", "F1@s1: no backward", m=3)


def test_refuses_recv_without_sender():
    lowered = built("gpipe", 2, 4)
    lowered[0].remove(Action(Kind.SEND_F, 3, 0))
    refuse(lowered, f"rank 1, slot {lowered[1].index(Action(Kind.RECV_F, 3, 1))}, RECV_F3@s1: no rank sends it", m=4)


def test_refuses_a_lost_receive_and_a_lost_micro_batch():
    lowered = built("gpipe", 2, 4)
    lowered[0].remove(Action(Kind.RECV_B, 2, 0))
    refuse(lowered, "rank 0, slot 12, B2@s0: runs before its input arrives (no RECV_B2@s0", m=4)
    lowered = built("gpipe", 2, 4)
    lowered[1] = [a for a in lowered[1] if a.microbatch != 2]
    refuse(lowered, "rank 1, slot 12 (end of list), F2@s1: missing", m=4)


def test_refuses_duplicate_forward():
    lowered = built("1f1b", 2, 2)
    lowered[0].insert(1, Action(F, 0, 0))
    refuse(lowered, "rank 0, slot 1, F0@s0: duplicate", "slot 0")


def test_refuses_backward_before_forward():
    lowered = parse("F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1", "RECV_F0@s1 F0 B0 SEND_B0 RECV_F1@s1 B1 F1 SEND_B1")
    refuse(lowered, "rank 1, slot 5, B1@s1: backward before its forward F1@s1")


def test_refuses_action_on_a_stage_the_rank_does_not_own():
    lowered = built("gpipe", 2, 2)
    lowered[0].append(Action(W, 0, 1))
    refuse(lowered, "rank 0, slot 8, W0@s1: stage 1 runs on rank 1, not on rank 0")


def test_refuses_messages_out_of_order_on_a_channel():
    lowered = parse("F0 F1 SEND_F0 SEND_F1 RECV_B0 B0 RECV_B1 B1",
                    "RECV_F1@s1 RECV_F0@s1 F0 F1 B0 SEND_B0 B1 SEND_B1")
    refuse(lowered, "rank 1, slot 0, RECV_F1@s1: out of order", "rank 0 first sends SEND_F0@s0 (its slot 2)")


def test_refuses_send_before_compute_and_split_backward_faults():
    refuse(parse("SEND_F0 F0 SEND_F1 F1 RECV_B0 B0 RECV_B1 B1", "RECV_F0@s1 F0 RECV_F1@s1 F1 B0 SEND_B0 B1 SEND_B1"),
           "rank 0, slot 0, SEND_F0@s0: sends the activation before F0@s0 computes it")
    refuse(parse("F0 W0 I0", ""), "rank 0, slot 1, W0@s0: W without its I", m=1)
    refuse(parse("F0 I0"), "rank 0, slot 1, I0@s0: no W follows it", m=1)
    refuse(parse("F0 B0 W0"), "rank 0, slot 2, W0@s0: W without its I; B already computed", m=1)


def test_refuses_comm_for_a_local_hand_over():
    lowered = lower(chunked(2, 1, 2, "v"), 2, 4, "v")
    k = lowered[1].index(Action(F, 0, 1)) + 1
    lowered[1].insert(k, Action(Kind.SEND_F, 0, 1))
    refuse(lowered, f"rank 1, slot {k}, SEND_F0@s1: stage 2 is on this rank too", m=1, placement="v", n_stages=4)


def test_stage_to_rank_agrees_with_rank_stages():
    for pp in (1, 2, 3, 4):
        for placement, vpp in (("loop", 1), ("loop", 3), ("v", 2)):
            for r in range(pp):
                assert all(stage_to_rank(s, pp, placement) == r for s in rank_stages(r, pp, vpp, placement))


# --- The README's "Writing a schedule" example, kept honest: a module outside the core. ----------------------

LATE_W = "tests.late_w_schedule:one_f_one_b_late_w"


def test_readme_example_schedule():
    compute, placement = load_schedule(PipelineSpec(pp=4, schedule=LATE_W, n_microbatches=8))
    lowered = lower(compute, 4, 4, placement)
    verify(lowered, 4, 4, 8, placement)
    costs = Costs(f=1, b=2, i=1, w=1)
    res = simulate(lowered, 4, 4, 8, placement, costs)
    assert (res.makespan, res.peak_live) == (30, [8] * 4)  # 1F1B: 33 and [4, 3, 2, 1]; ZB-H1: 27 and [4] * 4


@pytest.mark.parametrize("name, message", [
    ("module", "schedule=module needs schedule.module=<package.module:function> (a schedule generator)"),
    ("zigzag", f"schedule.name=zigzag is not a known schedule; use one of {', '.join(sorted(SCHEDULES))}, table with "
               "schedule.path=<file>, or module with schedule.module=<package.module:function>"),
    ("tests.no_such_module:f", "schedule.module=tests.no_such_module:f: cannot load it (No module named "
                               "'tests.no_such_module'); check the name and that its folder is on PYTHONPATH"),
    ("tests.late_w_schedule:nope", "schedule.module=tests.late_w_schedule:nope: cannot load it (module "
                                   "'tests.late_w_schedule' has no attribute 'nope'); check the name and that its "
                                   "folder is on PYTHONPATH"),
    ("tests.late_w_schedule:__doc__", "schedule.module=tests.late_w_schedule:__doc__ is not a function; name a "
                                      "schedule generator (pp, n_microbatches, vpp) -> per-rank lists of actions"),
])
def test_a_schedule_name_that_finds_nothing_says_what_to_write(name, message):
    with pytest.raises(ValueError) as refused:
        find_schedule(name)
    assert str(refused.value) == message


def test_a_module_may_register_its_schedule_with_its_rules(monkeypatch):
    import tests.late_w_schedule as module

    monkeypatch.setattr(module, "registered", RegisteredSchedule(gpipe, vpp=(1, 1)), raising=False)
    with pytest.raises(ValueError, match=r"^schedule 'tests.late_w_schedule:registered' runs 1 stage per rank"):
        load_schedule(PipelineSpec(pp=2, vpp=2, schedule="tests.late_w_schedule:registered", n_microbatches=2))
