"""The pre-launch check of a lowered schedule (`verify`) and its predicted step (`simulate`): times, bubble,
memory. Both refuse by one check (`check`: the static rules of `static_rules.py`, then `replay.run_strict`'s model of
waiting), so they accept the same schedules and word a refusal alike; `replay.replay` only times what passed."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import itemgetter

from .actions import B, F, W, Action, Costs, Lists
from .static_rules import ScheduleError, verify_static
from .collector import collector_paused
from .replay import replay, run_strict

__all__ = ["Costs", "ScheduleError", "SimResult", "Verified", "check", "peak_live", "predict", "simulate", "verify"]


@dataclass
class SimResult:
    """Predicted timing and memory of one training step under a lowered schedule."""

    start: list[list[float]]  # per rank, per slot (comm actions: when the batch was posted)
    end: list[list[float]]  # (comm actions: when their batch completed)
    makespan: float
    busy: list[float]  # compute time per rank
    bubble_fraction: float  # 1 - sum(busy) / (pp * makespan)
    peak_live: list[int]  # per rank: most micro-batches whose activations are held at once, all chunks
    actions: Lists = field(default_factory=list)  # the lowered schedule the times belong to


class Verified(tuple):
    """A lowered schedule that passed `verify`, and the (pp, n_stages, n_microbatches, placement) it passed
    for: rank lists as tuples, so it cannot change after the check, and `simulate` need not check it again."""

    checked_for: tuple[int, int, int, str]


def check(lowered: Lists, pp: int, n_stages: int, n_microbatches: int, placement: str) -> None:
    """Raise ScheduleError for the first fault: wrong stage, missing/duplicate work, unmatched P2P, deadlock."""
    verify_static(lowered, pp, n_stages, n_microbatches, placement)
    run_strict(lowered, pp, placement)


@collector_paused
def verify(lowered: Lists, pp: int, n_stages: int, n_microbatches: int, placement: str) -> Verified:
    """`check` the schedule and return it as `Verified` (hand that to `simulate`, which then skips the check)."""
    check(lowered, pp, n_stages, n_microbatches, placement)
    verified = Verified(map(tuple, lowered))
    verified.checked_for = (pp, n_stages, n_microbatches, placement)
    return verified


@collector_paused
def simulate(
    lowered: Lists, pp: int, n_stages: int, n_microbatches: int, placement: str, costs: Costs | None = None
) -> SimResult:
    """`check`, then replay the schedule as the runtime runs it with `costs`: times, makespan, bubble, memory.

    The check is skipped for what `verify` returned for the same arguments."""
    if not (isinstance(lowered, Verified) and lowered.checked_for == (pp, n_stages, n_microbatches, placement)):
        check(lowered, pp, n_stages, n_microbatches, placement)
    return predict(lowered, pp, n_stages, placement, costs)


@collector_paused
def predict(lowered: Lists, pp: int, n_stages: int, placement: str, costs: Costs | None = None) -> SimResult:
    """`simulate` without the check, for a schedule that already passed it (a `LoweredPipeline`'s)."""
    start, end, busy = replay(lowered, pp, n_stages, placement, costs or Costs())
    makespan = max(map(max, filter(None, end)), default=0.0)  # in C: a generator is a tenth of predict at pp=64
    bubble = 1.0 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0
    return SimResult(start, end, makespan, busy, bubble, [peak_live(actions) for actions in lowered], lowered)


_HELD = {F: 1, B: -1, W: -1}  # micro-batches whose activations each kind takes on (F) or frees (B, W)


def peak_live(actions: Iterable[Action], size: Callable[[int], int] | None = None) -> int:
    """Most activations one rank holds at once: F holds its stage's until B frees them, or under an I/W split
    until W does; `size(stage)` weighs a stage's (default 1: the peak counts micro-batches)."""
    if size is None:  # a running sum in C: this runs on every action of every step's prediction
        return max(accumulate(map(_HELD.get, map(itemgetter(0), actions), repeat(0)), initial=0))
    live = peak = 0
    for kind, _, stage in actions:
        if kind is F or kind is B or kind is W:
            held = 1 if size is None else size(stage)
            live += held if kind is F else -held
            peak = max(peak, live)
    return peak
