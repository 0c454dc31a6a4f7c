"""Variants in processes of their own, taking turns: one rank computes at a time (overhead.py, rollout.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from common import Times


def take_turns(step: Callable[[], Any], rank: int, world: int, warmup: int, rounds: int) -> Times:
    """Each rank runs its own variant (`step`), one rank at a time: a barrier passes the turn, A B then B A (no slot
    bias); this rank's step times after the warm-up rounds."""
    times = Times()
    for k in range(warmup + rounds):
        for turn in range(world) if k % 2 == 0 else reversed(range(world)):
            dist.barrier()
            if rank == turn:
                wall, cpu = time.perf_counter(), time.process_time()
                step()
                if k >= warmup:
                    times.wall.append(time.perf_counter() - wall)
                    times.cpu.append(time.process_time() - cpu)
    dist.barrier()
    return times
