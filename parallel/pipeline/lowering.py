"""Lowering: per-rank compute lists -> the lists a runtime executes, with every SEND_*/RECV_* in place.

SEND_*/RECV_* are placed so that, under the runtime's batched blocking P2P (a run of consecutive comm
actions is one `batch_isend_irecv` that waits for all of its ops), no schedule whose compute order is
feasible can deadlock. Time and memory are linear in the number of actions (times a log for the sorts).
"""

from __future__ import annotations

from bisect import bisect_left
from operator import itemgetter

from .actions import Action, Costs, Key, Lists, Schedule, hand_over, input_of, output_of
from .partition import stage_to_rank
from .sweep import Sweeps

Gaps = dict[int, list[tuple[tuple, Action]]]  # of one rank: gap index (before compute k) -> (sort key, comm op)


def lower(compute: Lists, pp: int, n_stages: int, placement: str, costs: Costs | None = None) -> Schedule:
    """Add SEND_*/RECV_* to per-rank compute lists; neighbouring stages on one rank hand over locally.

    Order: run the compute lists on a timeline (`costs`, default F=1 B=2 I=1 W=1) where every action starts
    as soon as its rank is free and its input exists. A cross-rank hand-over gets the time t its producer
    ends, and both its SEND and its RECV go, on their own rank, right after the last compute that started
    before t. So the SEND directly follows its producer, the RECV precedes its consumer, and whatever comes
    before an op on its rank depends only on hand-overs with a smaller t: by induction on t, both ends of
    every pair get posted while the other waits, and no feasible schedule can deadlock.
    In 1F1B this yields the classic pairing: `F(i) SEND_F(i) RECV_B(j) B(j) SEND_B(j) RECV_F(i+1)`.
    Compute lists that cannot run to the end (a broken schedule) get RECV-just-before / SEND-just-after
    for the part that never ran, so the pre-launch check can name the fault instead of this function.
    """
    costs = costs or Costs()
    if min(costs.f, costs.b, costs.i, costs.w) <= 0:
        raise ValueError("lowering needs positive compute costs (the placement argument relies on it)")
    owner = [stage_to_rank(s, pp, placement) for s in range(n_stages)]
    starts, ends = _timeline(compute, n_stages, owner, costs)
    gaps = _place_comm(compute, n_stages, owner, starts, ends)
    return [_merge(actions, gaps[r]) for r, actions in enumerate(compute)]


def _timeline(compute: Lists, n_stages: int, owner: list[int], costs: Costs) -> tuple[list[list[float]], ...]:
    """Start and end times of each rank's runnable prefix: list order per rank, inputs before use."""
    duration, comm = costs.durations(), costs.comm
    arrived: dict[Key, float] = {}  # keyed by the RECV that names an input: when it is there
    waiting: dict[Key, list[int]] = {}  # an input not there yet -> the ranks blocked on it
    starts: list[list[float]] = [[] for _ in compute]
    ends: list[list[float]] = [[] for _ in compute]
    sweeps = Sweeps(len(compute))
    for r in sweeps:
        actions, begun, done = compute[r], starts[r], ends[r]
        clock = done[-1] if done else 0.0
        for k in range(len(begun), len(actions)):
            a = actions[k]
            need = input_of(a, n_stages)
            t0 = clock
            if need is not None:
                if need not in arrived:
                    waiting.setdefault(need, []).append(r)
                    break  # its input is not there yet; another rank must move first
                t0 = max(clock, arrived[need])
            clock = t0 + duration[a[0]]
            begun.append(t0)
            done.append(clock)
            out = output_of(a, n_stages)
            if out is not None and out not in arrived:
                arrived[out] = clock + (comm if owner[out[2]] != r else 0.0)
                for q in waiting.pop(out, ()):
                    sweeps.wake(q)
    return starts, ends


def _place_comm(compute: Lists, n_stages: int, owner: list[int], starts: list[list[float]],
                ends: list[list[float]]) -> list[Gaps]:
    """Every cross-rank hand-over's SEND and RECV, each in the gap of its rank where it goes (see `lower`)."""
    gaps: list[Gaps] = [{} for _ in compute]
    consumers: dict[int, dict[Key, int]] = {}  # per rank, built when first needed: input -> first consumer
    for r, actions in enumerate(compute):
        ran = len(ends[r])
        for k, a in enumerate(actions):
            out = output_of(a, n_stages)
            if out is None or owner[out[2]] == r:
                continue  # nothing leaves the rank
            send, recv = hand_over(a, n_stages)
            q = owner[recv.stage]
            if k < ran:  # the producer ran on the timeline
                t = ends[r][k]
                # Ties in t: sends before receives in a batch, then a fixed order on both ends of a channel.
                gaps[r].setdefault(bisect_left(starts[r], t), []).append(((t, 0, send.stage, send.microbatch), send))
                gaps[q].setdefault(bisect_left(starts[q], t), []).append(((t, 1, send.stage, send.microbatch), recv))
            else:  # never ran: keep it local to the producer and the consumer, and let the check explain
                if q not in consumers:
                    consumers[q] = _first_consumers(compute[q], n_stages)
                gaps[r].setdefault(k + 1, []).append(((float("inf"), 0, 0, 0), send))
                gap = consumers[q].get(recv, len(compute[q]))
                gaps[q].setdefault(gap, []).append(((float("inf"), 1, 0, 0), recv))
    return gaps


def _first_consumers(actions: Lists, n_stages: int) -> dict[Key, int]:
    """Of one rank's compute list: each input it receives -> the index of its first compute that needs it."""
    first: dict[Key, int] = {}
    for k, a in enumerate(actions):
        need = input_of(a, n_stages)
        if need is not None:
            first.setdefault(need, k)
    return first


def _merge(actions: Lists, gaps: Gaps) -> list[Action]:
    """One rank's compute list with its comm ops in their gaps, each gap's ops in the order of their keys."""
    out: list[Action] = []
    done = 0
    for k in sorted(gaps):
        out += actions[done:k]
        out += [a for _, a in sorted(gaps[k], key=itemgetter(0))]
        done = k
    out += actions[done:]
    return out
