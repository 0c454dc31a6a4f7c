"""When a sent boundary tensor may go, proven from the lists: gloo reports a send done only once it is waited for.

A send X from rank r to rank q is done once r has received a message Y that q posted after the compute that
consumes X: q's runtime waits for X's data before that compute, so X had fully arrived before Y left.
The runtime waits for such sends while it is idle anyway (before it blocks), which returns at once and lets the
tensor go mid-step instead of at the end of the step.
"""

from collections.abc import Sequence

from .actions import Action, counterpart, input_of
from .partition import stage_to_rank
from .transport import SENDS


def send_releases(lists: Sequence[Sequence[Action]], rank: int, n_stages: int, placement: str,
                  pp: int) -> dict[Action, tuple[Action, ...]]:
    """For `rank`'s list: each RECV -> the SENDs of `rank` that its arrival proves done (sends it proves
    nothing about are waited for at the end of the step, as before)."""
    releases: dict[Action, list[Action]] = {}
    consumers: dict[int, dict[Action, int]] = {}  # peer -> RECV -> position of the compute consuming it
    next_send_back: dict[int, list[int | None]] = {}  # peer -> position -> index of its next SEND to `rank`
    for send in lists[rank]:
        if send.kind not in SENDS:
            continue
        recv = counterpart(send)
        peer = stage_to_rank(recv.stage, pp, placement)
        if peer not in consumers:  # only this rank's peers (two at most under loop or V placement) are read
            consumers[peer] = _consumer_positions(lists[peer], n_stages)
            next_send_back[peer] = _next_sends_to(lists[peer], rank, pp, placement)
        consumed_at = consumers[peer].get(recv)
        if consumed_at is None:
            continue
        reply = next_send_back[peer][consumed_at]
        if reply is not None:
            releases.setdefault(counterpart(lists[peer][reply]), []).append(send)
    return {recv: tuple(sends) for recv, sends in releases.items()}


def _consumer_positions(actions: Sequence[Action], n_stages: int) -> dict[Action, int]:
    """RECV -> the position of the compute in `actions` that consumes what it brings."""
    positions = {}
    for i, action in enumerate(actions):
        if not action.kind.is_comm:
            key = input_of(action, n_stages)
            if key is not None:
                positions[Action._make(key)] = i
    return positions


def _next_sends_to(actions: Sequence[Action], rank: int, pp: int, placement: str) -> list[int | None]:
    """For every position: the index of the first SEND to `rank` strictly after it (None if there is none)."""
    out: list[int | None] = [None] * len(actions)
    following = None
    for i in range(len(actions) - 1, -1, -1):
        out[i] = following
        action = actions[i]
        if action.kind in SENDS and stage_to_rank(counterpart(action).stage, pp, placement) == rank:
            following = i
    return out
