"""The static rules of a lowered schedule: everything that does not need to run it, in one pass per rule.

Ownership, order within a rank, completeness, P2P matching and channel order, each in time linear in the
number of actions. The first fault raises ScheduleError naming rank, slot and action.
"""

from __future__ import annotations

from .actions import MATES, RECV_B, RECV_F, B, F, I, SEND_B, SEND_F, W, Action, Key, Lists, mate_of, needs
from .partition import stage_to_rank

__all__ = ["ScheduleError", "verify_static"]


class ScheduleError(ValueError):
    """A schedule that would compute wrong numbers or hang; the message names rank, slot and action."""


def verify_static(lowered: Lists, pp: int, n_stages: int, m: int, placement: str) -> None:
    """Ownership, order within a rank, completeness, P2P matching and channel order: no run needed.

    Each rule is written once, in the form that names the first action breaking it; every pass is linear in
    the number of actions (pp=64, m=1024: about a second for 8 x 10^5 actions)."""
    if len(lowered) != pp:
        raise ScheduleError(f"the schedule has {len(lowered)} rank lists but parallel.pp={pp}")
    owner = [stage_to_rank(s, pp, placement) for s in range(n_stages)]
    slots = [_check_rank(lowered, r, owner, n_stages, m) for r in range(pp)]  # per rank: action -> its slot
    _check_complete(lowered, slots, owner, n_stages, m)
    _check_pairs(lowered, slots, owner, pp)


def _check_rank(lowered: Lists, r: int, owner: list[int], n_stages: int, m: int) -> dict[Key, int]:
    """Faults visible from rank r's list up to each slot; its actions -> their slots.

    One loop with each rule inline (a function call per action would double the time at pp=64): the common case
    costs a few set and dict lookups, and only a broken rule builds its message."""
    seen: dict[Key, int] = {}
    mine = {s for s in range(n_stages) if owner[s] == r}
    last = n_stages - 1
    for k, a in enumerate(lowered[r]):
        kind, mb, s = a
        if s not in mine or not 0 <= mb < m:
            if not 0 <= s < n_stages:
                _fail(r, k, a, f"stage {s} does not exist ({n_stages} stages)")
            if not 0 <= mb < m:
                _fail(r, k, a, f"micro-batch {mb} does not exist (n_microbatches={m})")
            _fail(r, k, a, f"stage {s} runs on rank {owner[s]}, not on rank {r}")
        if a in seen:
            _fail(r, k, a, f"duplicate; the same action is already at slot {seen[a]}")
        if kind is F:
            if s and (RECV_F, mb, s) not in seen and (s - 1 not in mine or (F, mb, s - 1) not in seen):
                _missing_input(lowered, r, k, a, seen, owner, n_stages)
        elif kind is B or kind is I:
            if (F, mb, s) not in seen:
                _fail(r, k, a, f"backward before its forward {Action(F, mb, s)}")
            if (B, mb, s) in seen or (I, mb, s) in seen:
                _fail(r, k, a, f"second backward of micro-batch {mb} on stage {s}")
            if s < last and (RECV_B, mb, s) not in seen and (
                    s + 1 not in mine or (B, mb, s + 1) not in seen and (I, mb, s + 1) not in seen):
                _missing_input(lowered, r, k, a, seen, owner, n_stages)
        elif kind is W:
            if (I, mb, s) not in seen:
                why = "B already computed the weight gradient" if (B, mb, s) in seen else \
                    f"it must follow {Action(I, mb, s)}"
                _fail(r, k, a, f"W without its I; {why}")
        else:
            _check_comm(r, k, a, seen, owner, n_stages)
        seen[a] = k
    return seen


def _check_comm(r: int, k: int, a: Action, seen: dict[Key, int], owner: list[int], n_stages: int) -> None:
    """A SEND after what it sends is computed; both ends on different ranks."""
    kind, mb, s = a
    if kind not in MATES:
        _fail(r, k, a, "a generation message (the sampled token's hop) has no place in a training schedule")
    if kind is SEND_F and (F, mb, s) not in seen:
        _fail(r, k, a, f"sends the activation before {Action(F, mb, s)} computes it")
    if kind is SEND_B and (B, mb, s) not in seen and (I, mb, s) not in seen:
        _fail(r, k, a, f"sends the gradient before B or I of micro-batch {mb} on stage {s} computes it")
    other = s + MATES[kind][1]  # the stage of the counterpart (mate_of)
    if not 0 <= other < n_stages:
        _fail(r, k, a, f"stage {s} has no neighbour stage {other} to talk to")
    if owner[other] == r:
        _fail(r, k, a, f"stage {other} is on this rank too; the hand-over is local and needs no {kind.value}")


def _missing_input(lowered: Lists, r: int, k: int, a: Action, seen: dict[Key, int], owner: list[int],
                   n_stages: int) -> None:
    """Raise for a compute whose input is not there yet: handed over locally too late, or never received."""
    kind, mb, s = a
    src = s - 1 if kind is F else s + 1  # the stage whose output this compute consumes
    makers = [Action(F, mb, src)] if kind is F else [Action(B, mb, src), Action(I, mb, src)]
    if owner[src] == r:  # that stage lives here too: the input is handed over locally
        _fail(r, k, a, f"runs before {' or '.join(map(str, makers))} produces its input on this rank")
    if not any(x in actions for actions in lowered for x in makers):  # why no RECV was lowered: no maker
        _fail(r, k, a, f"its input never comes: no rank runs {' or '.join(map(str, makers))}")
    _fail(r, k, a, f"runs before its input arrives (no {needs(a, n_stages)} earlier on this rank)")


def _check_complete(lowered: Lists, slots: list[dict[Key, int]], owner: list[int], n_stages: int, m: int) -> None:
    """Every stage runs F once per micro-batch, then a full backward (B, or I then W)."""
    for r, seen in enumerate(slots):
        for s in (s for s in range(n_stages) if owner[s] == r):
            for mb in range(m):
                f, i = (F, mb, s), (I, mb, s)
                if f not in seen:
                    _fail(r, f"{len(lowered[r])} (end of list)", Action._make(f),
                          f"missing; stage {s} never runs F for micro-batch {mb}")
                if (B, mb, s) not in seen and i not in seen:
                    _fail(r, seen[f], Action._make(f), f"no backward (B, or I then W) for micro-batch {mb} on stage {s}")
                if i in seen and (W, mb, s) not in seen:
                    _fail(r, seen[i], Action._make(i), "no W follows it, so the weight gradient is never computed")


def _check_pairs(lowered: Lists, slots: list[dict[Key, int]], owner: list[int], pp: int) -> None:
    """Every SEND has its RECV on the peer and vice versa (else the first without one is named), and each channel
    delivers in posting order (else the first RECV out of order is named)."""
    sent: list[dict[int, list[Action]]] = [{} for _ in range(pp)]  # rank -> peer -> its SENDs there, in order
    received: list[dict[int, list[Action]]] = [{} for _ in range(pp)]  # rank -> peer -> RECVs from it
    for r, actions in enumerate(lowered):
        for k, a in enumerate(actions):
            if a[0].is_comm:
                mate = mate_of(a)
                q = owner[mate[2]]
                if mate not in slots[q]:
                    verb = "receives" if a[0] in (SEND_F, SEND_B) else "sends"
                    _fail(r, k, a, f"no rank {verb} it (rank {q} has no {Action._make(mate)})")
                (sent if a[0] in (SEND_F, SEND_B) else received)[r].setdefault(q, []).append(a)
    # Messages between two ranks match in posting order (NCCL and gloo both pair them FIFO), so a
    # swapped pair would silently deliver one micro-batch's tensor as another's.
    for r in range(pp):
        for q in sorted(sent[r]):
            for s_act, r_act in zip(sent[r][q], received[q].get(r, ())):
                if mate_of(s_act) != r_act:
                    _fail(q, slots[q][r_act], r_act,
                          f"out of order: rank {r} first sends {s_act} (its slot {slots[r][s_act]}) and messages "
                          f"between two ranks are matched in posting order")


def _fail(rank: int, slot: int | str, action: Action, why: str) -> None:
    raise ScheduleError(f"rank {rank}, slot {slot}, {action}: {why}")
