"""Sent tensors leave mid-step: an arrival from a peer proves which of our sends it consumed, and a rank that
waits anyway waits for those sends then (gloo reports a send done only once it is waited for)."""

import random

import pytest

from parallel.engine import ParallelEngine
from parallel.grid import ParallelGrid
from parallel.pipeline import runtime
from parallel.pipeline.actions import Action, counterpart, input_of
from parallel.pipeline.lowered import lower_pipeline
from parallel.pipeline.lowering import lower
from parallel.pipeline.partition import stage_to_rank
from parallel.pipeline.release import send_releases
from parallel.pipeline.transport import SENDS, LocalPending
from parallel.spec import PipelineSpec
from tests.test_runtime import CPU, assert_grads_match, batches, dense_grads, layout_cfg, tiny
from tests.test_schedules import random_feasible



def test_1f1b_rank0_activations_are_released_by_the_gradients_that_follow_them():
    pipeline = lower_pipeline(PipelineSpec(pp=4, vpp=1, schedule="1f1b", n_microbatches=8), 8)
    releases = {str(recv): [str(s) for s in sends]
                for recv, sends in send_releases(pipeline.lowered, 0, 4, "loop", 4).items()}
    # Rank 1 sends B0 back only after it consumed F0..F2 (its warm-up); each later gradient follows one more F.
    assert releases == {"RECV_B0@s0": ["SEND_F0@s0", "SEND_F1@s0", "SEND_F2@s0"], "RECV_B1@s0": ["SEND_F3@s0"],
                        "RECV_B2@s0": ["SEND_F4@s0"], "RECV_B3@s0": ["SEND_F5@s0"], "RECV_B4@s0": ["SEND_F6@s0"],
                        "RECV_B5@s0": ["SEND_F7@s0"]}


@pytest.mark.parametrize("seed", range(4))
def test_every_release_follows_the_consumer_of_the_send_in_the_peers_list(seed):
    rng = random.Random(seed)
    pp = rng.randint(2, 4)
    placement, vpp = rng.choice([("loop", 1), ("loop", 2), ("v", 2)])
    n = pp * vpp
    lists = lower(random_feasible(rng, pp, 5, vpp, placement, split=seed % 2 == 1), pp, n, placement)
    for rank in range(pp):
        releases = send_releases(lists, rank, n, placement, pp)
        released = [s for sends in releases.values() for s in sends]
        assert len(released) == len(set(released)) and all(s.kind in SENDS and s in lists[rank] for s in released)
        for recv, sends in releases.items():
            reply = counterpart(recv)  # the peer's SEND that brings `recv`
            peer = lists[stage_to_rank(reply.stage, pp, placement)]
            for send in sends:
                consumer = next(i for i, a in enumerate(peer)
                                if not a.kind.is_comm and input_of(a, n) == tuple(counterpart(send)))
                assert consumer < peer.index(reply), (rank, send, recv)


def test_emulated_sends_that_never_report_done_are_waited_for_mid_step(monkeypatch):
    # Sends that report done only once waited for, as gloo's do (or, so the emulated step can end, once their
    # rank has run all its computes); the emulation blocks deterministically.
    engine = ParallelEngine(layout_cfg("1f1b", 2, 6), tiny(layers=4), ParallelGrid.single(CPU))
    last = {actions[-1].stage: [a for a in actions if not a.kind.is_comm][-1] for actions in engine.lists.values()}
    over: set[int] = set()
    original_compute = runtime._compute

    def compute(action, *args):
        original_compute(action, *args)
        if last[action.stage] == action:
            over.add(action.stage)

    def ready(self):
        if self.message.action.kind in SENDS:
            return getattr(self, "waited", False) or self.message.action.stage in over
        return self.matched

    original_wait = LocalPending.wait
    monkeypatch.setattr(runtime, "_compute", compute)
    monkeypatch.setattr(LocalPending, "ready", ready)
    monkeypatch.setattr(LocalPending, "wait", lambda self: (original_wait(self), setattr(self, "waited", True)))
    released: list[Action] = []
    original_release = runtime._Mail.release_done

    def release(mail):
        released.extend(a for a in mail.done if a in mail.sending)
        original_release(mail)

    monkeypatch.setattr(runtime._Mail, "release_done", release)
    mbs = batches(6)
    engine.step(mbs)
    # Rank 0 blocks before B1..B4 (B5's gradient is already there); each time the gradient of the micro-batch
    # before has proven that micro-batch's activation sent. F4 and F5 are waited for at the end of the step.
    assert sorted(str(a) for a in released if a.stage == 0) == [f"SEND_F{k}@s0" for k in range(4)]
    assert_grads_match(engine, dense_grads(tiny(layers=4), mbs))
