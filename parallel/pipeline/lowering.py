"""Lowering: per-rank compute lists -> the lists a runtime executes, with every SEND_*/RECV_* in place.

SEND_*/RECV_* are placed so that, under the runtime's batched blocking P2P (a run of consecutive comm
actions is one `batch_isend_irecv` that waits for all of its ops), no schedule whose compute order is
feasible can deadlock. Time and memory are linear in the number of actions (times a log for the sorts).
"""

from __future__ import annotations

import functools
from bisect import bisect_left

from .actions import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, Action, Costs, Key, Lists, Schedule, input_of
from .collector import collector_paused
from .partition import stage_to_rank
from .sweep import Sweeps

INF = float("inf")
_action = functools.partial(tuple.__new__, Action)  # Action from a (kind, mb, stage) tuple, without a Python call


@collector_paused
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
    ops = _place_comm(compute, n_stages, owner, starts, ends)
    return [_merge(actions, ops[r]) for r, actions in enumerate(compute)]


def _timeline(compute: Lists, n_stages: int, owner: list[int], costs: Costs) -> tuple[list[list[float]], ...]:
    """Start and end times of each rank's runnable prefix: list order per rank, inputs before use."""
    duration, comm, last = costs.durations(), costs.comm, n_stages - 1
    # Keyed by the RECV that names an input: when it is there. One dictionary per stage (any stage number
    # works, a broken schedule's too): small dictionaries stay in the CPU cache, one big one does not.
    arrived: list[dict[Key, float]] = [{} for _ in range(n_stages)]
    waiting: dict[Key, list[int]] = {}  # an input not there yet -> the ranks blocked on it
    starts: list[list[float]] = [[] for _ in compute]
    ends: list[list[float]] = [[] for _ in compute]
    sweeps = Sweeps(len(compute))
    for r in sweeps:
        actions, begun, done = compute[r], starts[r], ends[r]
        clock = done[-1] if done else 0.0
        for k in range(len(begun), len(actions)):
            kind, mb, s = actions[k]
            # input_of and output_of, inline: two calls per action are a third of this loop's time at pp=64.
            if kind is F:
                need = (RECV_F, mb, s) if s > 0 else None
                out = (RECV_F, mb, s + 1) if s < last else None
            elif kind is B or kind is I:
                need = (RECV_B, mb, s) if s < last else None
                out = (RECV_B, mb, s - 1) if s > 0 else None
            else:
                need = out = None
            t0 = clock
            if need is not None:
                ready = arrived[s % n_stages].get(need)
                if ready is None:
                    waiting.setdefault(need, []).append(r)
                    break  # its input is not there yet; another rank must move first
                if ready > clock:
                    t0 = ready
            clock = t0 + duration[kind]
            begun.append(t0)
            done.append(clock)
            if out is not None:
                box = arrived[out[2] % n_stages]
                if out not in box:
                    box[out] = clock + comm if owner[out[2]] != r else clock
                    for q in waiting.pop(out, ()):
                        sweeps.wake(q)
    return starts, ends


def _place_comm(compute: Lists, n_stages: int, owner: list[int], starts: list[list[float]],
                ends: list[list[float]]) -> list[list[tuple]]:
    """Every cross-rank hand-over's SEND and RECV on its rank, as (gap, sort key..., op), sorted (see `lower`).

    The gap is the index of the compute the op goes before; within a gap ops are ordered by the time t their
    producer ends, sends before receives, then stage and micro-batch (a fixed order on both ends of a
    channel), then the order they were found in (a broken schedule's ops that never ran share t = inf)."""
    ops: list[list[tuple]] = [[] for _ in compute]
    consumers: dict[int, dict[Key, int]] = {}  # per rank, built when first needed: input -> first consumer
    found, last = 0, n_stages - 1
    for r, actions in enumerate(compute):
        begun, done, mine = starts[r], ends[r], ops[r]
        ran = len(done)
        for k, (kind, mb, s) in enumerate(actions):
            # output_of and mate_of, inline (a call each per action is a third of this loop's time at pp=64).
            if kind is F and s < last:
                send, recv = _action((SEND_F, mb, s)), _action((RECV_F, mb, s + 1))
            elif (kind is B or kind is I) and s > 0:
                send, recv = _action((SEND_B, mb, s)), _action((RECV_B, mb, s - 1))
            else:
                continue
            q = owner[recv[2]]
            if q == r:
                continue  # nothing leaves the rank
            found += 1
            if k < ran:  # the producer ran on the timeline
                t = done[k]
                # The first compute that starts at t or later: almost always the next one (cheap to confirm).
                gap = k + 1 if k + 1 == ran or begun[k + 1] >= t > begun[k] else bisect_left(begun, t)
                mine.append((gap, t, 0, s, mb, found, send))
                ops[q].append((bisect_left(starts[q], t), t, 1, s, mb, found, recv))
            else:  # never ran: keep it local to the producer and the consumer, and let the check explain
                if q not in consumers:
                    consumers[q] = _first_consumers(compute[q], n_stages)
                mine.append((k + 1, INF, 0, 0, 0, found, send))
                ops[q].append((consumers[q].get(recv, len(compute[q])), INF, 1, 0, 0, found, recv))
    for rank_ops in ops:
        rank_ops.sort()
    return ops


def _first_consumers(actions: Lists, n_stages: int) -> dict[Key, int]:
    """Of one rank's compute list: each input it receives -> the index of its first compute that needs it."""
    first: dict[Key, int] = {}
    for k, a in enumerate(actions):
        need = input_of(a, n_stages)
        if need is not None:
            first.setdefault(need, k)
    return first


def _merge(actions: Lists, ops: list[tuple]) -> list[Action]:
    """One rank's compute list with its sorted comm ops, each before the compute of its gap."""
    out: list[Action] = []
    done = 0
    for op in ops:
        if op[0] > done:
            out += actions[done:op[0]]
            done = op[0]
        out.append(op[-1])
    out += actions[done:]
    return out
