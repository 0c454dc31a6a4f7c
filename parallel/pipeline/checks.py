"""Static checks of a lowered schedule: everything that does not need to run it, in one pass per rule.

Ownership, order within a rank, completeness, P2P matching and channel order, each in time linear in the
number of actions. The first fault raises ScheduleError naming rank, slot and action.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from operator import itemgetter

from .actions import MATES, B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Key, Lists, input_of, mate_of, needs
from .partition import stage_to_rank

__all__ = ["ScheduleError", "check"]


class ScheduleError(ValueError):
    """A schedule that would compute wrong numbers or hang; the message names rank, slot and action."""


def check(lowered: Lists, pp: int, n_stages: int, m: int, placement: str) -> None:
    """Ownership, order within a rank, completeness, P2P matching and channel order: no run needed."""
    if len(lowered) != pp:
        raise ScheduleError(f"the schedule has {len(lowered)} rank lists but parallel.pp={pp}")
    owner = [stage_to_rank(s, pp, placement) for s in range(n_stages)]
    # A proof that every rule holds, several times faster at pp=64; only where it fails do the passes below,
    # one rule at a time, look for the first fault to name.
    if _holds(lowered, owner, n_stages, m):
        return
    slots = [_check_rank(lowered, r, owner, n_stages, m) for r in range(pp)]  # per rank: action -> its slot
    _check_complete(lowered, slots, owner, n_stages, m)
    _check_pairs(lowered, slots, owner, pp)


def _holds(lowered: Lists, owner: list[int], n_stages: int, m: int) -> bool:
    """Every rule of the passes below: slots, stages and counts in bulk (in C), the order rules in one loop.

    Completeness by counting: without duplicates, every action valid, one backward per forward and every W
    after its I, the counts of F, of B and I, and of W against I say whether all the work is there. Pairing
    as in `_pairs_hold`, each SEND in `_in_order`, with the totals of SENDs and RECVs here."""
    slots = [dict(zip(actions, range(len(actions)))) for actions in lowered]  # per rank: action -> its slot
    sends = recvs = 0
    for r, actions in enumerate(lowered):
        if len(slots[r]) != len(actions) or not _well_formed(actions, r, owner, n_stages, m):
            return False
        count, units = Counter(map(itemgetter(0), actions)), m * owner.count(r)
        if count[F] != units or count[B] + count[I] != units or count[W] != count[I]:
            return False
        sends, recvs = sends + count[SEND_F] + count[SEND_B], recvs + count[RECV_F] + count[RECV_B]
        if not _in_order(actions, r, slots, owner, n_stages):
            return False
    return sends == recvs


def _well_formed(actions: Sequence[Action], r: int, owner: list[int], n_stages: int, m: int) -> bool:
    """Every stage on rank r and every micro-batch in range (comm actions' peers: see `_in_order`)."""
    if not set(map(itemgetter(2), actions)) <= {s for s in range(n_stages) if owner[s] == r}:
        return False
    return not actions or 0 <= min(map(itemgetter(1), actions)) <= max(map(itemgetter(1), actions)) < m


def _in_order(actions: Sequence[Action], r: int, slots: list[dict[Key, int]], owner: list[int], n_stages: int) -> bool:
    """The order rules of rank r (what must come before each slot), each SEND's peer stage on another rank,
    and its RECV there later on their channel than the RECV of the SEND before it.

    RECVs need no rule of their own: with as many RECVs as SENDs, each is the RECV of one of these SENDs."""
    n, last, mine = len(actions), n_stages - 1, slots[r]
    get = mine.get  # an action's slot on this rank; n where it is not on it
    latest = [-1] * len(slots)  # per peer rank: the slot there of the RECV of the latest SEND to it
    for k, (kind, mb, s) in enumerate(actions):
        if kind is F:
            if s and get((RECV_F, mb, s), n) > k and (owner[s - 1] != r or get((F, mb, s - 1), n) > k):
                return False
        elif kind is SEND_F:
            q = owner[s + 1] if s < last else r
            there = slots[q].get((RECV_F, mb, s + 1), -1)
            if q == r or get((F, mb, s), n) > k or there <= latest[q]:
                return False
            latest[q] = there
        elif kind is SEND_B:
            q = owner[s - 1] if s > 0 else r
            there = slots[q].get((RECV_B, mb, s - 1), -1)
            if q == r or get((B, mb, s), n) > k and get((I, mb, s), n) > k or there <= latest[q]:
                return False
            latest[q] = there
        elif kind is B or kind is I:
            if get((F, mb, s), n) > k or (I if kind is B else B, mb, s) in mine:
                return False  # no forward before it, or a second backward (before or after it)
            if s < last and get((RECV_B, mb, s), n) > k and (
                    owner[s + 1] != r or get((B, mb, s + 1), n) > k and get((I, mb, s + 1), n) > k):
                return False
        elif kind is W and get((I, mb, s), n) > k:
            return False
    return True


def _check_rank(lowered: Lists, r: int, owner: list[int], n_stages: int, m: int) -> dict[Key, int]:
    """Faults visible from rank r's list up to each slot; its actions -> their slots."""
    seen: dict[Key, int] = {}
    for k, a in enumerate(lowered[r]):
        kind, mb, s = a
        if not 0 <= s < n_stages:
            _fail(r, k, a, f"stage {s} does not exist ({n_stages} stages)")
        if not 0 <= mb < m:
            _fail(r, k, a, f"micro-batch {mb} does not exist (n_microbatches={m})")
        if owner[s] != r:
            _fail(r, k, a, f"stage {s} runs on rank {owner[s]}, not on rank {r}")
        if a in seen:
            _fail(r, k, a, f"duplicate; the same action is already at slot {seen[a]}")
        if kind.is_comm:
            _check_comm(r, k, a, seen, owner, n_stages)
        else:
            _check_compute(lowered, r, k, a, seen, owner, n_stages)
        seen[a] = k
    return seen


def _check_comm(r: int, k: int, a: Action, seen: dict[Key, int], owner: list[int], n_stages: int) -> None:
    """A SEND after what it sends is computed; both ends on different ranks."""
    kind, mb, s = a
    if kind is SEND_F and (F, mb, s) not in seen:
        _fail(r, k, a, f"sends the activation before {Action(F, mb, s)} computes it")
    if kind is SEND_B and (B, mb, s) not in seen and (I, mb, s) not in seen:
        _fail(r, k, a, f"sends the gradient before B or I of micro-batch {mb} on stage {s} computes it")
    other = s + MATES[kind][1]  # the stage of the counterpart (mate_of)
    if not 0 <= other < n_stages:
        _fail(r, k, a, f"stage {s} has no neighbour stage {other} to talk to")
    if owner[other] == r:
        _fail(r, k, a, f"stage {other} is on this rank too; the hand-over is local and needs no {kind.value}")


def _check_compute(lowered: Lists, r: int, k: int, a: Action, seen: dict[Key, int], owner: list[int],
                   n_stages: int) -> None:
    """A backward after its forward, W after I, and the input there before the compute."""
    kind, mb, s = a
    if kind is B or kind is I:
        if (F, mb, s) not in seen:
            _fail(r, k, a, f"backward before its forward {Action(F, mb, s)}")
        if (B, mb, s) in seen or (I, mb, s) in seen:
            _fail(r, k, a, f"second backward of micro-batch {mb} on stage {s}")
    elif kind is W:
        if (I, mb, s) not in seen:
            why = "B already computed the weight gradient" if (B, mb, s) in seen else f"it must follow {Action(I, mb, s)}"
            _fail(r, k, a, f"W without its I; {why}")
        return
    need = input_of(a, n_stages)
    if need is None or need in seen:
        return
    # Not received on this rank: the input is either handed over locally, or comes too late or never.
    src = s - 1 if kind is F else s + 1  # the stage whose output this compute consumes
    makers = [Action(F, mb, src)] if kind is F else [Action(B, mb, src), Action(I, mb, src)]
    if owner[src] == r:  # that stage lives here too: the input is handed over locally
        if not any(x in seen for x in makers):
            _fail(r, k, a, f"runs before {' or '.join(map(str, makers))} produces its input on this rank")
        return
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
    """Every SEND has its RECV on the peer and vice versa, and each channel delivers in posting order."""
    if not _pairs_hold(lowered, slots, owner, pp):
        _explain_pairs(lowered, slots, owner, pp)


def _pairs_hold(lowered: Lists, slots: list[dict[Key, int]], owner: list[int], pp: int) -> bool:
    """The pairing rules, in one pass: every SEND's RECV exists, later on its rank than the RECV of the SEND
    before it on the same channel, and there are as many RECVs as SENDs.

    Why this suffices: without duplicates, SENDs map one-to-one onto their RECVs; as many of both means every
    RECV has its SEND, and on each channel the pairing is a permutation, in posting order iff it increases."""
    n_sends = n_recvs = 0
    for actions in lowered:
        last = [-1] * pp  # per peer rank: slot (there) of the RECV paired with this rank's latest SEND to it
        for a in actions:
            kind = a[0]
            if kind is RECV_F or kind is RECV_B:
                n_recvs += 1
            elif kind is SEND_F or kind is SEND_B:
                n_sends += 1
                mate_kind, offset = MATES[kind]
                mate = (mate_kind, a[1], a[2] + offset)  # mate_of(a)
                q = owner[mate[2]]
                slot = slots[q].get(mate, -1)
                if slot <= last[q]:
                    return False
                last[q] = slot
    return n_sends == n_recvs


def _explain_pairs(lowered: Lists, slots: list[dict[Key, int]], owner: list[int], pp: int) -> None:
    """Raise for the first pairing fault: a comm action without its counterpart, then a channel out of order."""
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
