"""Running a checked, lowered schedule on all ranks at once, each as far as its inputs and messages allow.

A maximal run of consecutive SEND_*/RECV_* actions on a rank is posted as one batch (`batch_isend_irecv`);
messages between two ranks match in posting order. Two models of waiting:
- `run_strict` (the stricter, for `verify`): the rank waits for its whole batch where it posts it. An op
  completes once its counterpart is posted in the peer's current batch.
- `replay` (the runtime's, for `simulate`): the rank posts and moves on; a compute waits for the batch that
  carries its input, and the step ends when every batch is done. A batch completes as a unit once all its
  ops' peers have posted (NCCL coalesces it; gloo would let each op finish alone, which is never later).
The runtime blocks on a subset of what the stricter model blocks on, so whatever passes `verify` runs.
Both take a schedule that passed `checks.check`, visit ranks with `Sweeps` and run in linear time.
"""

from __future__ import annotations

from .actions import RECV_B, RECV_F, Costs, Key, Lists, counterpart, input_of, mate_of, needs, output_of
from .checks import ScheduleError
from .partition import stage_to_rank
from .sweep import Sweeps

Times = list[list[float]]  # per rank, per slot


def run_strict(lowered: Lists, pp: int, placement: str) -> None:
    """Run every rank, each waiting for its whole batch where it posts it; raise ScheduleError on deadlock.

    The check guarantees that every compute's input comes before it on its rank (received in an earlier
    batch, or made by an earlier compute), so here only batches wait."""
    pos = [0] * pp  # per rank: the slot to run next (past a posted batch while that is still open)
    first = [0] * pp  # per rank: the first slot of its latest batch
    open_ops = [0] * pp  # per rank: ops of its posted batch whose counterpart is not posted yet
    posted: dict[Key, int] = {}  # such an op -> its rank
    sweeps = Sweeps(pp)
    for r in sweeps:
        actions, k = lowered[r], pos[r]
        while k < len(actions) and not open_ops[r]:
            if not actions[k][0].is_comm:
                k += 1
                continue
            first[r] = k
            while k < len(actions) and actions[k][0].is_comm:  # post the whole run of comm actions at once
                q = posted.pop(mate_of(actions[k]), None)
                if q is None:
                    posted[actions[k]] = r
                    open_ops[r] += 1
                else:
                    open_ops[q] -= 1
                    if not open_ops[q]:
                        sweeps.wake(q)
                k += 1
        pos[r] = k
    if any(open_ops):
        raise ScheduleError("deadlock: " + "; ".join(_blocked(lowered, first, open_ops, posted, pp, placement)))


def _blocked(lowered: Lists, first: list[int], open_ops: list[int], posted: dict[Key, int], pp: int,
             placement: str) -> list[str]:
    """One line per stuck rank: the first slot of its batch that waits, and what it waits for."""
    lines = []
    for r, actions in enumerate(lowered):
        if not open_ops[r]:
            continue
        j = next(j for j in range(first[r], len(actions)) if actions[j] in posted)
        a, mate = actions[j], counterpart(actions[j])
        q = stage_to_rank(mate.stage, pp, placement)
        lines.append(f"rank {r}, slot {j}, {a} waits for rank {q} to post {mate} (its slot {lowered[q].index(mate)})")
    return lines


class _Replay:
    """The runtime's model: what `replay` tracks while it visits ranks (see the module docstring)."""

    def __init__(self, lowered: Lists, pp: int, n_stages: int, placement: str, costs: Costs):
        self.lowered, self.n_stages = lowered, n_stages
        self.owner = [stage_to_rank(s, pp, placement) for s in range(n_stages)]
        self.duration, self.comm = costs.durations(), costs.comm
        self.start: Times = [[0.0] * len(actions) for actions in lowered]
        self.end: Times = [[0.0] * len(actions) for actions in lowered]
        self.busy, self.clock, self.pos = [0.0] * pp, [0.0] * pp, [0] * pp
        self.arrived: dict[Key, float] = {}  # keyed by the RECV that names an input: when it is on its rank
        self.blocked: dict[Key, int] = {}  # an input not there yet -> the rank whose next compute needs it
        self.waiting: dict[Key, tuple[int, int, int]] = {}  # posted op, counterpart not yet -> rank, batch, slot
        self.open_ops: dict[tuple[int, int], int] = {}  # (rank, first slot) of a batch -> ops not matched yet
        self.matched: dict[tuple[int, int], float] = {}  # (rank, first slot) of a batch -> latest match so far
        self.sweeps = Sweeps(pp)

    def run(self, r: int) -> None:
        """Advance rank r until a compute's input is missing: computes in turn, batches posted without waiting."""
        actions, clock, n_stages = self.lowered[r], self.clock, self.n_stages
        k = self.pos[r]
        while k < len(actions):
            a = actions[k]
            if a[0].is_comm:
                k = self.post(r, k)
                continue
            t0, need = clock[r], input_of(a, n_stages)
            if need is not None:
                if need not in self.arrived:
                    self.blocked[need] = r
                    break
                t0 = max(t0, self.arrived[need])
            cost = self.duration[a[0]]
            self.start[r][k], self.end[r][k] = t0, t0 + cost
            clock[r] = t0 + cost
            self.busy[r] += cost
            out = output_of(a, n_stages)
            if out is not None and self.owner[out[2]] == r:
                self.arrived[out] = clock[r]  # local hand-over: no comm, the tensor is simply there
            k += 1
        self.pos[r] = k

    def post(self, r: int, first: int) -> int:
        """Post the batch starting at slot `first`; complete every batch whose last op this matches."""
        actions, now = self.lowered[r], self.clock[r]
        stop = first
        while stop < len(actions) and actions[stop][0].is_comm:
            stop += 1
        self.open_ops[r, first], self.matched[r, first] = stop - first, now
        for j in range(first, stop):
            self.start[r][j] = now
            mate = mate_of(actions[j])
            if mate not in self.waiting:
                self.waiting[actions[j]] = (r, first, j)
                continue
            q, q_first, _ = self.waiting.pop(mate)
            both_posted = max(now, self.start[q][q_first])
            for batch in ((r, first), (q, q_first)):
                self.matched[batch] = max(self.matched[batch], both_posted)
                self.open_ops[batch] -= 1
                if self.open_ops[batch] == 0:
                    self.complete(*batch)
        return stop

    def complete(self, r: int, first: int) -> None:
        """A batch is done: its ops end, its RECVs' tensors are there, whoever waits for one moves on."""
        done, actions = self.matched[r, first] + self.comm, self.lowered[r]
        j = first
        while j < len(actions) and actions[j][0].is_comm:
            self.end[r][j] = done
            if actions[j][0] in (RECV_F, RECV_B):
                self.arrived[actions[j]] = done
                if actions[j] in self.blocked:
                    self.sweeps.wake(self.blocked.pop(actions[j]))
            j += 1

    def stuck(self) -> list[str]:
        """Where each rank stopped, if it did not finish, and every op whose counterpart was never posted."""
        lines = [f"rank {r}, slot {k}, {actions[k]} waits for its input {needs(actions[k], self.n_stages)}"
                 for r, (actions, k) in enumerate(zip(self.lowered, self.pos)) if k < len(actions)]
        return lines + [f"rank {r}, slot {j}, {a} is never matched" for a, (r, _, j) in self.waiting.items()]


def replay(lowered: Lists, pp: int, n_stages: int, placement: str, costs: Costs) -> tuple[Times, Times, list[float]]:
    """Start and end of every slot and busy time per rank, as the runtime runs them; ScheduleError on deadlock."""
    state = _Replay(lowered, pp, n_stages, placement, costs)
    for r in state.sweeps:
        state.run(r)
    stuck = state.stuck()
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))
    return state.start, state.end, state.busy
