"""Receiving early: the runtime posts each RECV one compute ahead of its list place (and a rank that must wait
posts the next receives while it waits), keeping every order that matching depends on, and the numbers stay the
single-process ones."""

import random

import pytest

from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from parallel.pipeline.actions import RECV_F, SEND_F, Action
from parallel.pipeline.lowered import lower_pipeline
from parallel.pipeline.runtime import early_receive_runs
from parallel.pipeline.schedules import SCHEDULES, RegisteredSchedule
from parallel.pipeline.transport import SENDS, LocalEndpoint, LocalTransport
from parallel.spec import PipelineSpec
from tests.test_runtime import CPU, assert_grads_match, batches, dense_grads, layout_cfg, tiny
from tests.test_schedules import random_feasible



def computes_before(order: list) -> dict:
    """Each comm action -> how many compute actions precede it in `order`."""
    seen, out = 0, {}
    for action in order:
        if action.kind.is_comm:
            out[action] = seen
        else:
            seen += 1
    return out


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_each_receive_moves_one_compute_earlier_and_nothing_else_moves(name):
    vpp = SCHEDULES[name].default_vpp
    pipeline = lower_pipeline(PipelineSpec(pp=4, vpp=vpp, schedule=name, n_microbatches=8), 4 * vpp)
    for actions in pipeline.lowered:
        actions = list(actions)
        posted = [a for _, group in early_receive_runs(actions) for a in group]
        assert sorted(posted) == sorted(actions)
        for keep in (lambda a: not a.kind.is_comm or a.kind in SENDS, lambda a: a.kind.is_comm and a.kind not in SENDS):
            assert [a for a in posted if keep(a)] == [a for a in actions if keep(a)]  # computes+sends; receives
        before, after = computes_before(actions), computes_before(posted)
        for action, n in before.items():
            assert after[action] == (n if action.kind in SENDS else max(n - 1, 0)), action


def test_runs_alternate_and_keep_slots_in_order():
    pipeline = lower_pipeline(PipelineSpec(pp=4, vpp=2, schedule="interleaved-1f1b", n_microbatches=8), 8)
    runs = early_receive_runs(list(pipeline.lowered[1]))
    assert all(all(a.kind.is_comm for a in group) or len(group) == 1 for _, group in runs)
    assert not any(runs[i][1][0].kind.is_comm and runs[i + 1][1][0].kind.is_comm for i in range(len(runs) - 1))
    assert [slot for slot, _ in runs] == sorted(slot for slot, _ in runs)
    assert any(a.kind is SEND_F for _, group in runs for a in group)


def test_emulated_steps_with_early_receives_give_single_process_gradients(monkeypatch):
    # The emulation's channels match in posting order and name any deadlock: early receives, and the receives a
    # waiting rank posts ahead, must keep both.
    monkeypatch.setattr(LocalTransport, "receives_early", True, raising=False)
    rng = random.Random(5)
    mbs = batches(4)
    reference = dense_grads(tiny(layers=6), mbs)
    for name, vpp in [("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)]:
        engine = ParallelEngine(layout_cfg(name, 3 if vpp == 1 else 2, 4, vpp), tiny(layers=6),
                                ParallelGrid.single(CPU))
        assert all(program.receives_early for program in engine.programs.values())
        engine.step(mbs)
        assert_grads_match(engine, reference)
    for trial in range(6):
        pp = rng.randint(2, 3)
        placement, vpp = rng.choice([("loop", 1), ("loop", 2), ("v", 2)])
        compute = random_feasible(rng, pp, 4, vpp, placement, split=trial % 2 == 1)
        monkeypatch.setitem(SCHEDULES, "random", RegisteredSchedule(lambda *_, c=compute: c, placement, (vpp, vpp)))
        engine = ParallelEngine(layout_cfg("random", pp, 4, vpp), tiny(layers=6), ParallelGrid.single(CPU))
        engine.step(mbs)
        assert_grads_match(engine, reference)


def test_a_waiting_rank_posts_the_next_receives_before_it_blocks(monkeypatch):
    # Rank 2 (last stage) waits for F2's activation (rank 1 sends it only after its B0); while it waits it posts
    # RECV_F3, which the early rule alone would post only after F2, in the gap before B2 where nothing should
    # delay B2.
    monkeypatch.setattr(LocalTransport, "receives_early", True, raising=False)
    events: list[tuple[str, object]] = []
    original_post = LocalEndpoint.post

    def post(self, messages):
        events.extend(("post", m.action) for m in messages if self.rank == 2)
        return original_post(self, messages)

    monkeypatch.setattr(LocalEndpoint, "post", post)
    engine = ParallelEngine(layout_cfg("1f1b", 3, 4), tiny(layers=6), ParallelGrid.single(CPU))
    original_forward = engine.stages[2].forward

    def forward(microbatch, *args):
        events.append(("F", microbatch))
        return original_forward(microbatch, *args)

    monkeypatch.setattr(engine.stages[2], "forward", forward)
    mbs = batches(4)
    engine.step(mbs)
    posted = [a for what, a in events if what == "post"]
    assert sorted(posted) == sorted(a for a in engine.lists[2] if a.kind.is_comm)  # each transfer posted once
    assert events.index(("post", Action(RECV_F, 3, 2))) < events.index(("F", 2))
    assert_grads_match(engine, dense_grads(tiny(layers=6), mbs))
