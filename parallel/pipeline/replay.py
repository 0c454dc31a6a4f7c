"""Running a checked, lowered schedule on all ranks at once, each as far as its inputs and messages allow.

A maximal run of consecutive SEND_*/RECV_* actions on a rank is posted as one batch (`batch_isend_irecv`);
messages between two ranks match in posting order. One model of waiting decides whether a schedule runs:
- `run_strict` (what `verify` and `simulate` both refuse by): the rank waits for its whole batch where it posts
  it. An op completes once its counterpart is posted in the peer's current batch. Under NCCL a peer pair's ops
  share one stream in posting order, so a schedule that needs a later batch to complete an earlier one may hang
  there even where gloo would run it: the stricter model is the contract.
- `replay` (the times `simulate` predicts, for a schedule `run_strict` passed): the rank posts and moves on, as the
  runtime does; a compute waits for the batch that carries its input, and the step ends when every batch is done.
  A batch completes as a unit once all its ops' peers have posted (NCCL coalesces it; gloo would let each op
  finish alone, which is never later).
The runtime blocks on a subset of what the stricter model blocks on, so whatever passes `run_strict` runs, and
replays to the end (tests/test_schedule_agreement.py checks it over random mutants of every schedule).
Both take a schedule that passed `static_rules.verify_static`, visit ranks from a stack (in either model every order of
visits ends in the same state) and run in linear time.
"""

from __future__ import annotations

from collections.abc import Callable

from .actions import MATES, RECV_B, RECV_F, F, W, Costs, Key, Lists, counterpart, output_of
from .static_rules import ScheduleError
from .partition import stage_to_rank

Times = list[list[float]]  # per rank, per slot


def run_strict(lowered: Lists, pp: int, placement: str, mate: Callable[[Key], Key] | None = None,
               rank_of: Callable[[Key], int] | None = None) -> None:
    """Run every rank, each waiting for its whole batch where it posts it; raise ScheduleError on deadlock.

    The check guarantees that every compute's input comes before it on its rank (received in an earlier
    batch, or made by an earlier compute), so here only batches wait. Posting never holds another rank
    back, so every order of visits ends in the same state: a stack of ranks to run is the cheapest.
    `mate` and `rank_of` pair messages whose other end is not a neighbouring stage (generation's token: its
    counterpart and the rank that posts it); by default MATES does."""
    pos = [0] * pp  # per rank: the slot to run next (past a posted batch while that is still open)
    first = [0] * pp  # per rank: the first slot of its latest batch
    open_ops = [0] * pp  # per rank: ops of its posted batch whose counterpart is not posted yet
    posted: dict[Key, int] = {}  # such an op -> its rank
    found = mate  # the loop below rebinds `mate` per action
    mates = MATES.get if found is None else (lambda kind: _GIVEN if kind.is_comm else None)
    ready, pop = list(range(pp)), posted.pop  # locals: this loop runs once per action
    while ready:
        r = ready.pop()
        actions, k = lowered[r], pos[r]
        n = len(actions)
        while k < n and not open_ops[r]:
            if not actions[k][0].is_comm:
                k += 1
                continue
            first[r] = k
            while k < n:  # post the whole run of comm actions at once
                a = actions[k]
                mate = mates(a[0])
                if mate is None:
                    break  # a compute: the batch ends here
                q = pop((mate[0], a[1], a[2] + mate[1]) if found is None else found(a), None)  # the counterpart
                if q is None:
                    posted[a] = r
                    open_ops[r] += 1
                else:
                    open_ops[q] -= 1
                    if not open_ops[q]:
                        ready.append(q)
                k += 1
        pos[r] = k
    if any(open_ops):
        lines = _blocked(lowered, first, open_ops, posted, pp, placement, found, rank_of)
        raise ScheduleError("deadlock: " + "; ".join(lines))


_GIVEN = (None, 0)  # `run_strict`'s marker: a comm action whose counterpart the caller's `mate` gives


def _blocked(lowered: Lists, first: list[int], open_ops: list[int], posted: dict[Key, int], pp: int,
             placement: str, mate_fn: Callable[[Key], Key] | None = None,
             rank_of: Callable[[Key], int] | None = None) -> list[str]:
    """One line per stuck rank: the first slot of its batch that waits, and what it waits for."""
    lines = []
    for r, actions in enumerate(lowered):
        if not open_ops[r]:
            continue
        j = next(j for j in range(first[r], len(actions)) if actions[j] in posted)
        a = actions[j]
        mate = counterpart(a) if mate_fn is None else type(a)._make(mate_fn(a))
        q = stage_to_rank(mate.stage, pp, placement) if rank_of is None else rank_of(mate)
        lines.append(f"rank {r}, slot {j}, {a} waits for rank {q} to post {mate} (its slot {lowered[q].index(mate)})")
    return lines


class _Replay:
    """The runtime's model: what `replay` tracks while it visits ranks (see the module docstring).

    A batch is a list: its rank, first and stop slot, when it was posted, the latest time one of its matches
    had both ends posted, and how many of its ops are not matched yet."""

    def __init__(self, lowered: Lists, pp: int, n_stages: int, placement: str, costs: Costs):
        self.lowered, self.n_stages = lowered, n_stages
        self.owner = [stage_to_rank(s, pp, placement) for s in range(n_stages)]
        # Neighbouring stages on one rank (the V placement, or pp=1) hand over locally: only then look.
        self.local = any(self.owner[s] == self.owner[s + 1] for s in range(n_stages - 1))
        self.duration = costs.stage_durations(n_stages)  # kind -> per-stage durations
        self.comm = costs.comm
        self.boundary = costs.boundary_comm(n_stages) if costs.stage_comm else None  # per boundary, if uneven
        self.start: Times = [[0.0] * len(actions) for actions in lowered]
        self.end: Times = [[0.0] * len(actions) for actions in lowered]
        self.busy, self.clock, self.pos = [0.0] * pp, [0.0] * pp, [0] * pp
        self.arrived: dict[Key, float] = {}  # keyed by the RECV that names an input: when it is on its rank
        self.blocked: dict[Key, int] = {}  # an input not there yet -> the rank whose next compute needs it
        self.waiting: dict[Key, list] = {}  # a posted op whose counterpart is not posted yet -> its batch
        self.ready = list(range(pp))  # ranks that can move (a stack: the order of visits does not matter)

    def run(self, r: int) -> None:
        """Advance rank r until a compute's input is missing: computes in turn, batches posted without waiting."""
        actions, n_stages, arrived, duration = self.lowered[r], self.n_stages, self.arrived, self.duration
        start, end, clock, busy, k = self.start[r], self.end[r], self.clock[r], self.busy[r], self.pos[r]
        n, last, local, owner = len(actions), n_stages - 1, self.local, self.owner
        while k < n:
            a = actions[k]
            kind = a[0]
            if kind.is_comm:
                k = self.post(r, k, clock)
                continue
            # input_of, inline (a call per action is a fifth of the replay at pp=64)
            need = ((RECV_F, a[1], a[2]) if a[2] > 0 else None) if kind is F else (
                None if kind is W or a[2] >= last else (RECV_B, a[1], a[2]))
            t0 = clock
            if need is not None:
                # Each input has one consumer (checked): dropping it keeps the dictionary small, so fast.
                ready = arrived.pop(need, None)
                if ready is None:
                    self.blocked[need] = r
                    break
                if ready > clock:
                    t0 = ready
            cost = duration[a[0]][a[2]]
            start[k] = t0
            end[k] = clock = t0 + cost
            busy += cost
            if local:
                out = output_of(a, n_stages)
                if out is not None and owner[out[2]] == r:
                    arrived[out] = clock  # local hand-over: no comm, the tensor is simply there
            k += 1
        self.clock[r], self.busy[r], self.pos[r] = clock, busy, k

    def post(self, r: int, first: int, now: float) -> int:
        """Post the batch starting at slot `first` at time `now`; complete every batch this finishes matching."""
        actions, waiting, start, mates = self.lowered[r], self.waiting, self.start[r], MATES.get
        mine = [r, first, first, now, now, 0]  # its stop slot and open ops are counted below
        k, n = first, len(actions)
        while k < n:
            a = actions[k]
            mate = mates(a[0])
            if mate is None:
                break  # a compute: the batch ends here
            start[k] = now
            k += 1
            theirs = waiting.pop((mate[0], a[1], a[2] + mate[1]), None)  # the counterpart's batch, as mate_of(a)
            if theirs is None:
                waiting[a] = mine
                mine[5] += 1
                continue
            both_posted = now if now > theirs[3] else theirs[3]  # comparisons, not max(): the hot path
            if both_posted > mine[4]:
                mine[4] = both_posted
            if both_posted > theirs[4]:
                theirs[4] = both_posted
            theirs[5] -= 1
            if not theirs[5]:
                self.complete(theirs)
        mine[2] = k
        if not mine[5]:
            self.complete(mine)
        return k

    def complete(self, batch: list) -> None:
        """A batch is done: its ops end, its RECVs' tensors are there, whoever waits for one moves on."""
        r, first, stop, _, matched, _ = batch
        actions, arrived, blocked = self.lowered[r], self.arrived, self.blocked
        done = matched + (self.comm if self.boundary is None else self.batch_comm(actions[first:stop]))
        self.end[r][first:stop] = [done] * (stop - first)
        for a in actions[first:stop]:
            kind = a[0]
            if kind is RECV_F or kind is RECV_B:
                arrived[a] = done
                if a in blocked:
                    self.ready.append(blocked.pop(a))

    def batch_comm(self, ops: Lists) -> float:
        """Transfer time of a batch under per-boundary costs: its slowest boundary (the batch ends as a unit)."""
        return max(self.boundary[min(s, s + MATES[kind][1])] for kind, _, s in ops)


def replay(lowered: Lists, pp: int, n_stages: int, placement: str, costs: Costs) -> tuple[Times, Times, list[float]]:
    """Start and end of every slot and busy time per rank, as the runtime runs them, for a schedule that passed
    `run_strict` (every input and message has one source, so the times do not depend on the order of visits)."""
    state = _Replay(lowered, pp, n_stages, placement, costs)
    while state.ready:
        state.run(state.ready.pop())
    for r, (actions, k) in enumerate(zip(lowered, state.pos)):
        if k < len(actions):  # the module docstring's argument broken: a bug in this file, not the user's schedule
            raise ScheduleError(f"rank {r}, slot {k}, {actions[k]}: the replay stops here though run_strict ran the "
                                "schedule; call replay only on a schedule that passed verify")
    return state.start, state.end, state.busy
