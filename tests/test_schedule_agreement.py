"""`verify` and `simulate` agree: one model of waiting accepts or refuses a schedule for both, in the same words,
and whatever it accepts the runtime's replay times to the end (property tests over every registered schedule)."""

import random

from hypothesis import event, given, settings, strategies as st

from parallel.pipeline.actions import Action
from parallel.pipeline.lowering import lower
from parallel.pipeline.schedules import SCHEDULES
from parallel.pipeline.simulate import ScheduleError, simulate, verify
from tests.test_pipeline_lowered import mutate


def shift_comm(lowered: list[list[Action]], rng: random.Random) -> list[list[Action]]:
    """Post one RECV earlier or one SEND later on its rank: the static rules mostly still hold, so waiting decides."""
    out = [list(actions) for actions in lowered]
    r = rng.randrange(len(out))
    comm = [k for k, a in enumerate(out[r]) if a.kind.is_comm]
    if comm:
        k = rng.choice(comm)
        action = out[r].pop(k)
        earlier = action.kind.value.startswith("RECV")
        out[r].insert(rng.randint(0, k) if earlier else rng.randint(k, len(out[r])), action)
    return out


def answer(run) -> str | list:
    """A run's predicted end times ("verified" for verify), or the one line it was refused with."""
    try:
        return getattr(run(), "end", "verified")
    except ScheduleError as err:
        return str(err)


def agree(data: st.DataObject) -> None:
    """One random mutant of one registered schedule: verify and simulate accept it together or refuse it alike."""
    # The registry is read when the test runs, not when it is collected: test_schedule_registry runs it again with
    # a schedule inserted.
    name = data.draw(st.sampled_from(sorted(SCHEDULES)), label="schedule")
    registered = SCHEDULES[name]
    pp = data.draw(st.integers(2, 4), label="pp")
    shapes = [m for m in range(1, 9) if not registered.microbatches_multiple_of_pp or m % pp == 0]
    m = data.draw(st.sampled_from(shapes), label="m")
    vpp, placement = registered.default_vpp, registered.placement
    n = pp * vpp
    schedule = lower(registered.generate(pp, m, vpp), pp, n, placement)
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))  # uniform, unlike a drawn Random
    for _ in range(data.draw(st.integers(1, 2), label="mutations")):
        schedule = shift_comm(schedule, rng) if rng.random() < 0.8 else mutate(schedule, rng, m, n)
    verified = answer(lambda: verify(schedule, pp, n, m, placement))
    simulated = answer(lambda: simulate(schedule, pp, n, m, placement))
    event("accepted" if verified == "verified" else "deadlock" if verified.startswith("deadlock") else "static fault")
    if verified == "verified":
        assert isinstance(simulated, list), simulated  # accepted by both: the replay ran every slot of every rank
        assert [len(ends) for ends in simulated] == list(map(len, schedule))
    else:
        assert simulated == verified  # refused by both, in the same words: one line naming the action
        assert verified.startswith(("rank ", "deadlock: rank ")) and "\n" not in verified, verified


SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, database=None)
test_verify_and_simulate_agree_on_every_mutant = SETTINGS(given(data=st.data())(agree))
