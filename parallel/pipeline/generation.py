"""Generation as a schedule: ticks of micro-batches of sequences flowing through the stages, each tick's sampled token
going back from the last stage to the first as the input of the same micro-batch's next tick.

A unit u = tick * M + m is micro-batch m's forward at that tick (the prompt at a round's first tick of the first
round, prefill; one token otherwise), so a unit is what a micro-batch is to a training schedule and F(u, s) is
stage s's forward of it (no backward). Every rank runs its stages' forwards tick by tick, micro-batch by micro-batch:
with M >= pp micro-batches, micro-batch m's token is back at the first stage by the time the first stage has run the
other M - 1 micro-batches of the tick, so a stage waits only while the pipeline fills (pp - 1 forwards at the start)
and drains (pp - 1 at the end). The token's hop (SEND_T on the last stage, RECV_T on the first) is in the lists like every
other message, so the verifier sees the cycle tick -> token -> next tick and refuses an ordering that deadlocks.
"""

from __future__ import annotations

import functools
from bisect import bisect_left

from .actions import RECV_F, RECV_T, SEND_F, SEND_T, Action, Key, Kind, Lists, Schedule, mate_of
from .partition import rank_stages, stage_to_rank
from .replay import run_strict
from .simulate import SimResult
from .static_rules import ScheduleError

F = Kind.F


def generation_compute(pp: int, n_stages: int, placement: str, n_microbatches: int, ticks: int) -> Schedule:
    """Rank r: for each tick, for each of its stages in order, F of every micro-batch."""
    m = n_microbatches
    return [[Action(F, t * m + mb, s) for t in range(ticks) for s in rank_stages(r, pp, n_stages // pp, placement)
             for mb in range(m)] for r in range(pp)]


def token_mate(action: Key, n_microbatches: int, n_stages: int) -> Key:
    """The other end of a message: SEND_T(u, last) <-> RECV_T(u + M, 0); a neighbour's as MATES pairs it."""
    kind, unit, stage = action
    if kind is SEND_T:
        return RECV_T, unit + n_microbatches, 0
    if kind is RECV_T:
        return SEND_T, unit - n_microbatches, n_stages - 1
    return mate_of(action)


def generation_peer(action: Action, n_microbatches: int, n_stages: int, placement: str, pp: int) -> int:
    """The pipeline rank at the other end of a message of a generation list."""
    return stage_to_rank(token_mate(action, n_microbatches, n_stages)[2], pp, placement)


def lower_generation(compute: Lists, pp: int, n_stages: int, placement: str, n_microbatches: int) -> Schedule:
    """Add the messages, placed as `lowering.lower` places a training schedule's: run the lists on a unit-cost
    timeline (a token feeds the first stage's next tick), then put each hand-over's SEND and RECV, on their own ranks,
    right after the last compute that started before the producer ended. Both ends of every pair are then posted
    while the other waits, by induction on that time, so no feasible ordering deadlocks (the verifier checks)."""
    owner = [stage_to_rank(s, pp, placement) for s in range(n_stages)]
    last, m = n_stages - 1, n_microbatches
    units = 1 + max((a.microbatch for actions in compute for a in actions), default=-1)
    starts, ends = _timeline(compute, owner, m)
    ops: list[list[tuple]] = [[] for _ in compute]
    for r, actions in enumerate(compute):
        for k, (_, u, s) in enumerate(actions):
            if s < last and owner[s + 1] != r:
                send, recv = Action(SEND_F, u, s), Action(RECV_F, u, s + 1)
            elif s == last and u + m < units and owner[0] != r:
                send, recv = Action(SEND_T, u, s), Action(RECV_T, u + m, 0)
            else:
                continue
            t, q = ends[r][k], owner[recv.stage]
            ops[r].append((bisect_left(starts[r], t), t, 0, s, u, send))
            ops[q].append((bisect_left(starts[q], t), t, 1, s, u, recv))
    lowered = []
    for actions, mine in zip(compute, ops):
        mine.sort()
        out, done = [], 0
        for op in mine:
            out += actions[done:op[0]]
            done = max(done, op[0])
            out.append(op[-1])
        lowered.append(out + list(actions[done:]))
    return lowered


def _timeline(compute: Lists, owner: list[int], m: int) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end of every compute at unit cost: list order per rank, an input (the previous stage's output, or
    the token of the micro-batch's previous tick) before its use. Raises ScheduleError if some list cannot finish."""
    last = len(owner) - 1
    done: dict[tuple[int, int], float] = {}  # (unit, stage) -> end
    starts: list[list[float]] = [[] for _ in compute]
    ends: list[list[float]] = [[] for _ in compute]
    moved = True
    while moved:
        moved = False
        for r, actions in enumerate(compute):
            for _, u, s in actions[len(ends[r]):]:
                need = (u, s - 1) if s > 0 else (u - m, last) if u >= m else None
                if need is not None and need not in done:
                    break
                t0 = max(ends[r][-1] if ends[r] else 0.0, done[need] if need is not None else 0.0)
                starts[r].append(t0)
                ends[r].append(t0 + 1.0)
                done[(u, s)] = t0 + 1.0
                moved = True
    for r, actions in enumerate(compute):
        if len(ends[r]) < len(actions):
            _fail(r, len(ends[r]), actions[len(ends[r])], "waits for an input no rank can produce first")
    return starts, ends


@functools.lru_cache(maxsize=16)
def generation_lists(pp: int, n_stages: int, placement: str, n_microbatches: int,
                     ticks: int) -> tuple[tuple[Action, ...], ...]:
    """The verified, lowered lists of one round of `ticks` ticks over `n_microbatches` micro-batches."""
    compute = generation_compute(pp, n_stages, placement, n_microbatches, ticks)
    lowered = lower_generation(compute, pp, n_stages, placement, n_microbatches)
    verify_generation(lowered, pp, n_stages, placement, n_microbatches, ticks)
    return tuple(map(tuple, lowered))


def simulate_generation(lowered: Lists, pp: int, n_stages: int, placement: str, n_microbatches: int) -> SimResult:
    """A round's predicted timeline at unit cost per forward (messages free, posted where they stand): what
    `scripts/preview.py --generate` draws. Nothing is held for a backward, so the peak live micro-batches are 0."""
    compute = [[a for a in actions if not a.kind.is_comm] for actions in lowered]
    starts, ends = _timeline(compute, [stage_to_rank(s, pp, placement) for s in range(n_stages)], n_microbatches)
    start, end = [], []
    for r, actions in enumerate(lowered):
        k, clock, rs, re = 0, 0.0, [], []
        for a in actions:
            if a.kind.is_comm:
                rs.append(clock)
                re.append(clock)
            else:
                rs.append(starts[r][k])
                re.append(ends[r][k])
                clock = ends[r][k]
                k += 1
        start.append(rs)
        end.append(re)
    makespan = max((e[-1] for e in ends if e), default=0.0)
    busy = [float(len(e)) for e in ends]
    bubble = 1.0 - sum(busy) / (pp * makespan) if makespan else 0.0
    return SimResult(start, end, makespan, busy, bubble, [0] * pp, lowered)


def verify_generation(lowered: Lists, pp: int, n_stages: int, placement: str, n_microbatches: int, ticks: int) -> None:
    """Raise ScheduleError naming rank, slot and action for the first fault: a stage on the wrong rank, a missing or
    duplicate forward, an input used before it arrives, an unmatched or reordered message, a deadlock."""
    if len(lowered) != pp:
        raise ScheduleError(f"the generation schedule has {len(lowered)} rank lists but parallel.pp={pp}")
    owner = [stage_to_rank(s, pp, placement) for s in range(n_stages)]
    m, units = n_microbatches, n_microbatches * ticks
    slots = [_check_rank(actions, r, owner, m, units) for r, actions in enumerate(lowered)]
    for r, seen in enumerate(slots):
        for s in (s for s in range(n_stages) if owner[s] == r):
            for u in range(units):
                if (F, u, s) not in seen:
                    _fail(r, f"{len(lowered[r])} (end of list)", Action(F, u, s),
                          f"missing; stage {s} never runs tick {u // m} of micro-batch {u % m}")
    _check_pairs(lowered, slots, owner, m, n_stages)
    run_strict(lowered, pp, placement, mate=lambda a: token_mate(a, m, n_stages),
               rank_of=lambda a: owner[a.stage])


def _check_rank(actions: Lists, r: int, owner: list[int], m: int, units: int) -> dict[Key, int]:
    """Ownership, no duplicates, every input before its use, every send after what it sends; actions -> slots."""
    seen: dict[Key, int] = {}
    last = len(owner) - 1
    for k, a in enumerate(actions):
        kind, u, s = a
        if not 0 <= s <= last:
            _fail(r, k, a, f"stage {s} does not exist ({last + 1} stages)")
        if owner[s] != r:
            _fail(r, k, a, f"stage {s} runs on rank {owner[s]}, not on rank {r}")
        if not 0 <= u < units:
            _fail(r, k, a, f"unit {u} does not exist ({units // m} ticks x {m} micro-batches)")
        if a in seen:
            _fail(r, k, a, f"duplicate; the same action is already at slot {seen[a]}")
        if kind is F:
            if s > 0 and (RECV_F, u, s) not in seen and (owner[s - 1] != r or (F, u, s - 1) not in seen):
                _fail(r, k, a, f"runs before its input arrives (no {Action(RECV_F, u, s)} or local F{u}@s{s - 1} "
                               "earlier on this rank)")
            if s == 0 and u >= m and (RECV_T, u, 0) not in seen and (owner[last] != r or (F, u - m, last) not in seen):
                _fail(r, k, a, f"runs before the token of tick {u // m - 1} arrives (no {Action(RECV_T, u, 0)} "
                               "earlier on this rank)")
        elif kind in (SEND_F, SEND_T) and (F, u, s) not in seen:
            _fail(r, k, a, f"sends before {Action(F, u, s)} computes it")
        elif kind in (Kind.B, Kind.I, Kind.W, Kind.SEND_B, Kind.RECV_B):
            _fail(r, k, a, "generation has no backward")
        seen[a] = k
    return seen


def _check_pairs(lowered: Lists, slots: list[dict[Key, int]], owner: list[int], m: int, n_stages: int) -> None:
    """Every message has its other end on the peer, and each channel delivers in posting order."""
    sent: dict[tuple[int, int], list[Key]] = {}
    received: dict[tuple[int, int], list[Key]] = {}
    for r, actions in enumerate(lowered):
        for k, a in enumerate(actions):
            if not a.kind.is_comm:
                continue
            mate = token_mate(a, m, n_stages)
            q = owner[mate[2]] if 0 <= mate[2] < n_stages else -1
            if q < 0 or mate not in slots[q]:
                _fail(r, k, a, f"no rank posts its other end {Action._make(mate)}")
            sends = a.kind in (SEND_F, SEND_T)
            (sent if sends else received).setdefault((r, q) if sends else (q, r), []).append(a)
    for (r, q), sends in sent.items():
        for s_act, r_act in zip(sends, received.get((r, q), ())):
            if token_mate(s_act, m, n_stages) != r_act:
                _fail(q, slots[q][r_act], Action._make(r_act), f"out of order: rank {r} first sends {s_act} and "
                      "messages between two ranks are matched in posting order")


def _fail(rank: int, slot: int | str, action: Action, why: str) -> None:
    raise ScheduleError(f"rank {rank}, slot {slot}, {action}: {why}")

