"""The order in which the lowering and the replays visit ranks: linear time, round-robin results.

Each of them runs every rank as far as it can and repeats until nothing moves. A plain round-robin
(`while progress: for r in range(pp): run r until it blocks`) costs sweeps x ranks, superlinear at scale.
`Sweeps` visits ranks in exactly the round-robin's order but skips those still blocked, which that loop
would visit for nothing: a blocked rank is visited again only once an event has unblocked it (`wake`).
So the work is linear in the number of actions, and every result, including which of two equal events
comes first, is the round-robin's.
"""

from __future__ import annotations

from collections.abc import Iterator
from heapq import heapify, heappop, heappush


class Sweeps:
    """Ranks to visit, in round-robin order: iterate, run the rank until it blocks, `wake` what it unblocked."""

    def __init__(self, n_ranks: int):
        self._now = list(range(n_ranks))  # this sweep's ranks still to visit (a heap)
        self._queued = set(self._now)
        self._next: set[int] = set()  # ranks to visit in the next sweep
        self._rank = -1  # the rank being visited

    def wake(self, rank: int) -> None:
        """`rank` can move again: later in this sweep if it comes after the rank being visited, else next sweep."""
        if rank > self._rank:
            if rank not in self._queued:
                self._queued.add(rank)
                heappush(self._now, rank)
        else:
            self._next.add(rank)

    def __iter__(self) -> Iterator[int]:
        heapify(self._now)
        while self._now or self._next:
            if not self._now:
                self._now, self._next = sorted(self._next), set()
                self._queued = set(self._now)
            self._rank = heappop(self._now)
            self._queued.discard(self._rank)
            yield self._rank
