"""The order in which the lowering visits ranks: linear time, round-robin results.

It runs every rank as far as it can and repeats until nothing moves. A plain round-robin
(`while progress: for r in range(pp): run r until it blocks`) costs sweeps x ranks, superlinear at scale.
`Sweeps` visits ranks in exactly the round-robin's order but skips those still blocked, which that loop
would visit for nothing: a blocked rank is visited again only once an event has unblocked it (`wake`).
So the work is linear in the number of actions, and every result, including which of two equal events
comes first, is the round-robin's.
"""

from __future__ import annotations

from collections.abc import Iterator


class Sweeps:
    """Ranks to visit, in round-robin order: iterate, run the rank until it blocks, `wake` what it unblocked."""

    def __init__(self, n_ranks: int):
        # One flag per rank, in bytearrays: `find` skips the ranks still blocked in C (a scan of at most
        # n_ranks bytes per visit), a tenth of the cost of a heap and sets per visit at pp=64.
        self._now = bytearray(b"\x01" * n_ranks)  # this sweep's ranks still to visit (those after `_rank`)
        self._next = bytearray(n_ranks)  # ranks to visit in the next sweep
        self._rank = -1  # the rank being visited

    def wake(self, rank: int) -> None:
        """`rank` can move again: later in this sweep if it comes after the rank being visited, else next sweep."""
        if rank > self._rank:
            self._now[rank] = 1
        else:
            self._next[rank] = 1

    def __iter__(self) -> Iterator[int]:
        now, later, idle = self._now, self._next, bytes(len(self._now))
        while True:
            rank = now.find(1, self._rank + 1)
            if rank < 0:  # the sweep is over: the next one visits the ranks woken for it
                if later.find(1) < 0:
                    return
                now[:], later[:], self._rank = later, idle, -1
                continue
            now[rank] = 0
            self._rank = rank
            yield rank
