"""Check a lowered schedule before launch (ownership, completeness, matching, no deadlock) and simulate it.

A maximal run of consecutive SEND_*/RECV_* actions on a rank is posted as one batch (`batch_isend_irecv`);
messages between two ranks match in posting order. Two models of waiting:
- `verify` (the stricter): the rank waits for its whole batch where it posts it. An op completes once its
  counterpart is posted in the peer's current batch.
- `simulate` (the runtime's): the rank posts and moves on; a compute waits for the batch that carries its
  input, and the step ends when every batch is done. A batch completes as a unit once all its ops' peers
  have posted (NCCL coalesces it; gloo would let each op finish alone, which is never later).
The runtime blocks on a subset of what the stricter model blocks on, so whatever passes `verify` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action, Costs, Kind, Schedule
from .partition import stage_to_rank
from .schedules import counterpart, hand_over, needs

__all__ = ["Costs", "ScheduleError", "SimResult", "plan_text", "simulate", "verify"]

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


class ScheduleError(ValueError):
    """A schedule that would compute wrong numbers or hang; the message names rank, slot and action."""


@dataclass
class SimResult:
    """Predicted timing and memory of one training step under a lowered schedule."""

    start: list[list[float]]  # per rank, per slot (comm actions: when the batch was posted)
    end: list[list[float]]  # (comm actions: when their batch completed)
    makespan: float
    busy: list[float]  # compute time per rank
    bubble_fraction: float  # 1 - sum(busy) / (pp * makespan)
    peak_live: list[int]  # per rank: most micro-batches whose activations are held at once, all chunks
    actions: Schedule = field(default_factory=list)  # the lowered schedule the times belong to


def verify(lowered: Schedule, pp: int, n_stages: int, n_microbatches: int, placement: str) -> None:
    """Raise ScheduleError for the first fault: wrong stage, missing/duplicate work, unmatched P2P, deadlock."""
    _check(lowered, pp, n_stages, n_microbatches, placement)
    _run(lowered, pp, n_stages, placement, Costs())


def simulate(
    lowered: Schedule, pp: int, n_stages: int, n_microbatches: int, placement: str, costs: Costs | None = None
) -> SimResult:
    """Check, then replay the schedule as the runtime runs it with `costs`: times, makespan, bubble, memory."""
    costs = costs or Costs()
    _check(lowered, pp, n_stages, n_microbatches, placement)
    start, end, busy = _replay(lowered, pp, n_stages, placement, costs)
    makespan = max((t for row in end for t in row), default=0.0)
    bubble = 1.0 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0
    return SimResult(start, end, makespan, busy, bubble, [_peak_live(actions) for actions in lowered], lowered)


def _peak_live(actions: list[Action]) -> int:
    """Activations are held from F until B frees them, or under an I/W split until W does."""
    live = peak = 0
    for a in actions:
        live += {F: 1, B: -1, W: -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


# --- Static checks: everything that does not need to run the schedule. ---------------------------------


def _check(lowered: Schedule, pp: int, n_stages: int, m: int, placement: str) -> None:
    """Ownership, order within a rank, completeness, P2P matching and channel order: no run needed."""
    if len(lowered) != pp:
        raise ScheduleError(f"the schedule has {len(lowered)} rank lists but parallel.pp={pp}")
    owner = [stage_to_rank(s, pp, placement) for s in range(n_stages)]
    slots: list[dict[Action, int]] = []  # per rank: action -> its slot
    everywhere = {a for actions in lowered for a in actions}
    for r, actions in enumerate(lowered):
        seen: dict[Action, int] = {}
        for k, a in enumerate(actions):
            _check_action(r, k, a, seen, owner, n_stages, m, everywhere)
            seen[a] = k
        slots.append(seen)

    # Every stage runs F once per micro-batch, then a full backward (B, or I then W).
    for r, seen in enumerate(slots):
        for s in (s for s in range(n_stages) if owner[s] == r):
            for mb in range(m):
                f, i = Action(F, mb, s), Action(I, mb, s)
                if f not in seen:
                    end = f"{len(lowered[r])} (end of list)"
                    _fail(r, end, f, f"missing; stage {s} never runs F for micro-batch {mb}")
                if Action(B, mb, s) not in seen and i not in seen:
                    _fail(r, seen[f], f, f"no backward (B, or I then W) for micro-batch {mb} on stage {s}")
                if i in seen and Action(W, mb, s) not in seen:
                    _fail(r, seen[i], i, "no W follows it, so the weight gradient is never computed")

    # Every SEND has its RECV on the peer and vice versa.
    for r, seen in enumerate(slots):
        for a, k in seen.items():
            if a.kind.is_comm:
                mate = counterpart(a)
                q = owner[mate.stage]
                if mate not in slots[q]:
                    verb = "receives" if a.kind in (Kind.SEND_F, Kind.SEND_B) else "sends"
                    _fail(r, k, a, f"no rank {verb} it (rank {q} has no {mate})")

    # Messages between two ranks match in posting order (NCCL and gloo both pair them FIFO), so a
    # swapped pair would silently deliver one micro-batch's tensor as another's.
    for r, actions in enumerate(lowered):
        for q in range(pp):
            sent = [a for a in actions if a.kind in (Kind.SEND_F, Kind.SEND_B) and owner[counterpart(a).stage] == q]
            recv = [a for a in lowered[q] if a.kind in (Kind.RECV_F, Kind.RECV_B) and owner[counterpart(a).stage] == r]
            for s_act, r_act in zip(sent, recv):
                if counterpart(s_act) != r_act:
                    _fail(
                        q, slots[q][r_act], r_act,
                        f"out of order: rank {r} first sends {s_act} (its slot {slots[r][s_act]}) and messages "
                        f"between two ranks are matched in posting order",
                    )


def _check_action(
    r: int, k: int, a: Action, seen: dict[Action, int], owner: list[int], n_stages: int, m: int, everywhere: set[Action]
) -> None:
    """Faults visible from one rank's list up to slot k (and, to explain a missing input, all ranks' actions)."""
    mb, s = a.microbatch, a.stage
    if not 0 <= s < n_stages:
        _fail(r, k, a, f"stage {s} does not exist ({n_stages} stages)")
    if not 0 <= mb < m:
        _fail(r, k, a, f"micro-batch {mb} does not exist (n_microbatches={m})")
    if owner[s] != r:
        _fail(r, k, a, f"stage {s} runs on rank {owner[s]}, not on rank {r}")
    if a in seen:
        _fail(r, k, a, f"duplicate; the same action is already at slot {seen[a]}")

    def did(kind: Kind) -> bool:
        return Action(kind, mb, s) in seen

    if a.kind in (B, I):
        if not did(F):
            _fail(r, k, a, f"backward before its forward {Action(F, mb, s)}")
        if did(B) or did(I):
            _fail(r, k, a, f"second backward of micro-batch {mb} on stage {s}")
    if a.kind is W and not did(I):
        why = "B already computed the weight gradient" if did(B) else f"it must follow {Action(I, mb, s)}"
        _fail(r, k, a, f"W without its I; {why}")
    if a.kind is Kind.SEND_F and not did(F):
        _fail(r, k, a, f"sends the activation before {Action(F, mb, s)} computes it")
    if a.kind is Kind.SEND_B and not (did(B) or did(I)):
        _fail(r, k, a, f"sends the gradient before B or I of micro-batch {mb} on stage {s} computes it")
    if a.kind.is_comm:
        other = counterpart(a).stage
        if not 0 <= other < n_stages:
            _fail(r, k, a, f"stage {s} has no neighbour stage {other} to talk to")
        if owner[other] == r:
            _fail(r, k, a, f"stage {other} is on this rank too; the hand-over is local and needs no {a.kind.value}")
        return
    need = needs(a, n_stages)
    if need is None:
        return
    src = s - 1 if a.kind is F else s + 1  # the stage whose output this compute consumes
    if owner[src] == r:  # that stage lives here too: the input is handed over locally
        makers = [Action(F, mb, src)] if a.kind is F else [Action(B, mb, src), Action(I, mb, src)]
        if not any(x in seen for x in makers):
            _fail(r, k, a, f"runs before {' or '.join(map(str, makers))} produces its input on this rank")
    elif need not in seen:
        makers = [Action(F, mb, src)] if a.kind is F else [Action(B, mb, src), Action(I, mb, src)]
        if not any(x in everywhere for x in makers):  # say why no RECV was lowered: nobody makes the input
            _fail(r, k, a, f"its input never comes: no rank runs {' or '.join(map(str, makers))}")
        _fail(r, k, a, f"runs before its input arrives (no {need} earlier on this rank)")


def _fail(rank: int, slot: int | str, action: Action, why: str) -> None:
    raise ScheduleError(f"rank {rank}, slot {slot}, {action}: {why}")


# --- The run: compute when inputs exist, comm batches when both ends are posted. -----------------------


@dataclass
class _ReplayState:
    """What both replays track: stage owners, per-slot start/end, busy time, clocks, list positions, and
    `arrived` (keyed by the RECV that names an input: when that input is on its rank)."""

    owner: list[int]
    start: list[list[float]]
    end: list[list[float]]
    busy: list[float]
    clock: list[float]
    pos: list[int]
    arrived: dict[Action, float]

    @classmethod
    def fresh(cls, lowered: Schedule, pp: int, n_stages: int, placement: str) -> "_ReplayState":
        return cls([stage_to_rank(s, pp, placement) for s in range(n_stages)],
                   [[0.0] * len(actions) for actions in lowered], [[0.0] * len(actions) for actions in lowered],
                   [0.0] * pp, [0.0] * pp, [0] * pp, {})

    def compute(self, a: Action, r: int, k: int, n_stages: int, costs: Costs) -> bool:
        """Run compute action `a` (slot k of rank r) if its input is there; False if it has to wait."""
        need = needs(a, n_stages)
        if need is not None and need not in self.arrived:
            return False
        self.start[r][k] = max(self.clock[r], self.arrived.get(need, 0.0))
        self.end[r][k] = self.clock[r] = self.start[r][k] + costs.of(a.kind)
        self.busy[r] += costs.of(a.kind)
        pair = hand_over(a, n_stages)
        if pair is not None and self.owner[pair[1].stage] == r:
            self.arrived[pair[1]] = self.clock[r]  # local hand-over: no comm, the tensor is simply there
        self.pos[r] += 1
        return True


def _run(
    lowered: Schedule, pp: int, n_stages: int, placement: str, costs: Costs
) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """Replay all ranks under the batch model; raise ScheduleError naming every blocked rank on deadlock."""
    state = _ReplayState.fresh(lowered, pp, n_stages, placement)
    owner, start, end, busy, clock, pos, arrived = (state.owner, state.start, state.end, state.busy, state.clock,
                                                    state.pos, state.arrived)
    batch: list[range | None] = [None] * pp  # the slots of each rank's posted, unfinished batch
    done: dict[tuple[int, int], float] = {}  # (rank, slot) of a finished comm op -> when

    def step(r: int) -> bool:
        """Advance rank r by one compute action or one whole batch; False if it has to wait."""
        actions, k = lowered[r], pos[r]
        a = actions[k]
        if not a.kind.is_comm:
            return state.compute(a, r, k, n_stages, costs)
        if batch[r] is None:  # post the whole run of comm actions at once
            stop = next((j for j in range(k, len(actions)) if not actions[j].kind.is_comm), len(actions))
            batch[r] = range(k, stop)
            for j in batch[r]:
                start[r][j] = clock[r]
        for j in batch[r]:
            if (r, j) not in done:
                match(r, j)
        if any((r, j) not in done for j in batch[r]):
            return False
        for j in batch[r]:
            end[r][j] = done[(r, j)]
        clock[r] = max([clock[r]] + [done[(r, j)] for j in batch[r]])
        pos[r], batch[r] = batch[r].stop, None
        return True

    def match(r: int, j: int) -> None:
        """Complete op j of rank r if its counterpart is posted in the peer's current batch."""
        a = lowered[r][j]
        mate = counterpart(a)
        q = owner[mate.stage]
        for j2 in batch[q] or ():
            if (q, j2) not in done and lowered[q][j2] == mate:
                t = max(start[r][j], start[q][j2]) + costs.comm
                done[(r, j)] = done[(q, j2)] = t
                arrived[a if a.kind in (Kind.RECV_F, Kind.RECV_B) else mate] = t
                return

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(lowered[r]) and step(r):
                progress = True
    if any(pos[r] < len(lowered[r]) for r in range(pp)):
        raise ScheduleError("deadlock: " + "; ".join(_blocked(lowered, pos, batch, done, owner, n_stages)))
    return start, end, busy


def _replay(
    lowered: Schedule, pp: int, n_stages: int, placement: str, costs: Costs
) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """Replay all ranks as the runtime runs them: post batches without waiting, wait for inputs at computes."""
    state = _ReplayState.fresh(lowered, pp, n_stages, placement)
    start, end, busy, clock, pos, arrived = state.start, state.end, state.busy, state.clock, state.pos, state.arrived
    waiting: dict[Action, tuple[int, int]] = {}  # posted op whose counterpart is not posted yet -> (rank, batch)
    open_ops: dict[tuple[int, int], int] = {}  # (rank, first slot) of a batch -> its ops not matched yet
    matched: dict[tuple[int, int], float] = {}  # (rank, first slot) of a batch -> latest match so far

    def post(r: int, first: int) -> None:
        """Post the batch starting at slot `first`; complete every batch whose last op this matches."""
        actions = lowered[r]
        stop = next((j for j in range(first, len(actions)) if not actions[j].kind.is_comm), len(actions))
        open_ops[r, first], matched[r, first] = stop - first, clock[r]
        for j in range(first, stop):
            start[r][j] = clock[r]
            mate = counterpart(actions[j])
            if mate not in waiting:
                waiting[actions[j]] = (r, first)
                continue
            peer = waiting.pop(mate)
            both_posted = max(clock[r], start[peer[0]][peer[1]])
            for b in ((r, first), peer):
                matched[b] = max(matched[b], both_posted)
                open_ops[b] -= 1
                if open_ops[b] == 0:
                    complete(*b)
        pos[r] = stop

    def complete(r: int, first: int) -> None:
        done = matched[r, first] + costs.comm
        for j in range(first, len(lowered[r])):
            a = lowered[r][j]
            if not a.kind.is_comm:
                break
            end[r][j] = done
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                arrived[a] = done

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(lowered[r]):
                k, a = pos[r], lowered[r][pos[r]]
                if a.kind.is_comm:
                    post(r, k)
                elif not state.compute(a, r, k, n_stages, costs):
                    break  # the batch carrying its input is not complete yet
                progress = True
    stuck = [f"rank {r}, slot {pos[r]}, {lowered[r][pos[r]]} waits for its input {needs(lowered[r][pos[r]], n_stages)}"
             for r in range(pp) if pos[r] < len(lowered[r])]
    stuck += [f"rank {r}, slot {lowered[r].index(a)}, {a} is never matched" for a, (r, _) in waiting.items()]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))
    return start, end, busy


def _blocked(
    lowered: Schedule,
    pos: list[int],
    batch: list[range | None],
    done: dict[tuple[int, int], float],
    owner: list[int],
    n_stages: int,
) -> list[str]:
    """One line per stuck rank: the slot and action it waits on, and what it waits for."""
    lines = []
    for r, actions in enumerate(lowered):
        if pos[r] == len(actions):
            continue
        k, a = pos[r], actions[pos[r]]
        if not a.kind.is_comm:
            lines.append(f"rank {r}, slot {k}, {a} waits for its input {needs(a, n_stages)}")
            continue
        j = next(j for j in batch[r] if (r, j) not in done)
        a, mate = actions[j], counterpart(actions[j])
        q = owner[mate.stage]
        where = next((f"its slot {i}" for i, b in enumerate(lowered[q]) if b == mate), "nowhere")
        lines.append(f"rank {r}, slot {j}, {a} waits for rank {q} to post {mate} ({where})")
    return lines


# --- Drawing. -------------------------------------------------------------------------------------------


def plan_text(
    lowered: Schedule, pp: int, n_stages: int, n_microbatches: int, placement: str, costs: Costs | None = None
) -> str:
    """A rank x time grid of the compute actions (one column per time quantum), with bubble and memory."""
    costs = costs or Costs()
    res = simulate(lowered, pp, n_stages, n_microbatches, placement, costs)
    quantum = min(c for c in (costs.f, costs.b, costs.i, costs.w, costs.comm) if c > 0)
    label = (lambda a: f"{a.kind.value}{a.microbatch}") if n_stages == pp else str
    width = 1 + max((len(label(a)) for actions in lowered for a in actions if not a.kind.is_comm), default=2)
    n_cols = round(res.makespan / quantum)
    lines = [
        f"pp={pp} stages={n_stages} micro-batches={n_microbatches} placement={placement}  "
        f"(F={costs.f:g} B={costs.b:g} I={costs.i:g} W={costs.w:g} comm={costs.comm:g}; "
        f"one column = {quantum:g}, '.' idle)"
    ]
    for r, actions in enumerate(lowered):
        cells = [".".ljust(width)] * n_cols
        for k, a in enumerate(actions):
            if a.kind.is_comm:
                continue
            c0, c1 = round(res.start[r][k] / quantum), round(res.end[r][k] / quantum)
            cells[c0] = label(a).ljust(width)
            for c in range(c0 + 1, c1):
                cells[c] = "-" * (width - 1) + " "
        lines.append(f"rank {r:<3}| " + "".join(cells).rstrip())
    lines.append(
        f"makespan {res.makespan:g}, bubble {res.bubble_fraction:.1%}, "
        f"peak live micro-batches per rank {res.peak_live}"
    )
    return "\n".join(lines)
