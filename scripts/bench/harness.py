"""How every benchmark measures and records: steps timed from a common start, variants in turn (A B, then B A),
medians and per-round ratios, and the sections of results.json."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common import ROOT

RESULTS = ROOT / "bench" / "results.json"


# --- Timing, in turns --------------------------------------------------------------------------------------------


def timed(step: Callable[[], Any], everyone: bool = True, busiest: bool = False) -> tuple[float, float, Any]:
    """One step on every rank from a common start: the slowest rank's wall time, the CPU time of all ranks
    together (what the step costs whatever else the machine runs; `busiest`: the busiest rank's, the critical
    path's work), and the step's result. `everyone=False`: this process's own step, while the other ranks wait
    at their next barrier."""
    together = everyone and dist.is_initialized()
    if together:
        dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    out = step()
    spent = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64)
    if together:
        if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
            spent = spent.to(torch.device("cuda", torch.cuda.current_device()))
        wall, cpu_sum = spent.clone(), spent.clone()
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu_sum, op=dist.ReduceOp.MAX if busiest else dist.ReduceOp.SUM)
        spent = torch.stack([wall[0], cpu_sum[1]])
    return float(spent[0]), float(spent[1]), out


@dataclass
class Times:
    """One variant's measured steps: wall time (slowest rank) and CPU time (all ranks), in seconds."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, wall: float, cpu: float) -> None:
        self.wall.append(wall)
        self.cpu.append(cpu)

    def summary(self, prefix: str) -> dict:
        """`{prefix}_s` (median wall), `{prefix}_min_s`, `{prefix}_cpu_s` (median CPU) and the raw runs."""
        return {f"{prefix}_s": statistics.median(self.wall), f"{prefix}_min_s": min(self.wall),
                f"{prefix}_cpu_s": statistics.median(self.cpu), f"{prefix}_runs_s": self.wall}


def paired(row: dict) -> dict:
    """Each round ran one Sluice step and one torch step back to back: the median of their differences and how
    many rounds Sluice won. Two medians taken apart can differ by chance more than this; it shows a tie as one."""
    diffs = [a - b for a, b in zip(row["sluice_runs_s"], row["torch_runs_s"])]
    return {"paired_diff_ms": 1000 * statistics.median(diffs), "sluice_wins": sum(d < 0 for d in diffs),
            "rounds": len(diffs)}


def in_turn(names: list, k: int) -> list:
    """Round k's order: as given, reversed every other round (A B, B A, ...: a step's slot in the round biases it,
    e.g. the second slot measured 1.06-1.13x the first with two equal eager variants at pp2, and a fixed order
    would charge that to one side)."""
    return list(names) if k % 2 == 0 else list(names)[::-1]


def alternate(variants: dict[str, Callable[[], Any]], warmup: int, rounds: int,
              busiest: bool = False) -> dict[str, Times]:
    """Warm every variant up, then run one step of each per round, in turn (`in_turn`); step times by variant."""
    for _ in range(warmup):
        for step in variants.values():
            timed(step)
    times = {name: Times() for name in variants}
    for r in range(rounds):
        for name in in_turn(variants, r):
            times[name].add(*timed(variants[name], busiest=busiest)[:2])
    return times


def take_turns(step: Callable[[], Any], rank: int, world: int, warmup: int, rounds: int) -> Times:
    """Each rank runs its own variant (`step`) in a process of its own, one rank at a time: a barrier passes the
    turn, in turn (`in_turn`); this rank's step times after the warm-up rounds (overhead.py, rollout.py)."""
    times = Times()
    for k in range(warmup + rounds):
        for turn in in_turn(range(world), k):
            dist.barrier()
            if rank == turn:
                wall, cpu, _ = timed(step, everyone=False)
                if k >= warmup:
                    times.add(wall, cpu)
    dist.barrier()
    return times


def repeated(step: Callable[[], Any], repeat: int) -> tuple[Times, Any]:
    """`repeat` runs of step() in this process alone, one after another: their times and the last result."""
    times, out = Times(), None
    for _ in range(repeat):
        wall, cpu, out = timed(step, everyone=False)
        times.add(wall, cpu)
    return times, out


def first_then_alternate(steps: dict[str, Callable[[list], Any]], micro: list, warmup: int, rounds: int) -> dict:
    """Each variant's first loss on `micro` (the same weights and data give the same loss), then their step times
    taken in turns (`alternate`)."""
    first = {name: step(micro) for name, step in steps.items()}
    times = alternate({name: (lambda step=step: step(micro)) for name, step in steps.items()}, warmup, rounds)
    return {"times": times, "first_loss": first}


# --- Results -------------------------------------------------------------------------------------------


def bench_parser(doc: str, smoke_help: str, rounds: int, warmup: int | None = None) -> argparse.ArgumentParser:
    """The options of every benchmark script: --smoke, --rounds, --warmup (where it warms up) and --results."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--rounds", type=int, default=rounds)
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--results", type=Path, default=RESULTS)
    return parser


def machine() -> dict:
    """What the figures were measured on."""
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def update_results(section: str, value: Any, path: Path = RESULTS) -> None:
    """Write one section of results.json, keeping the others."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data[section] = value
    data["machine"] = machine()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free interval of the median of `values`: order statistics k and n + 1 - k, k the largest with
    P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2 (at least 1), and the coverage that interval has."""
    ordered, n = sorted(values), len(values)

    def below(k: int) -> float:  # P(Binomial(n, 1/2) < k): the chance the median lies below order statistic k
        return sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and below(k + 1) <= (1 - confidence) / 2:
        k += 1
    return ordered[k - 1], ordered[n - k], 1 - 2 * below(k)


def ratio_and_spread(ours: list[float], theirs: list[float]) -> dict:
    """The median of the per-round ratios ours / theirs (each round ran one step of each back to back), their
    spread (half the interquartile range; 0 with one round) and the ratios themselves."""
    return median_and_spread([a / b for a, b in zip(ours, theirs)])


def median_and_spread(ratios: list[float]) -> dict:
    """Per-round ratios summed up: their median, their spread (half the interquartile range; 0 with one round) and
    the ratios themselves."""
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"ratio": statistics.median(ratios), "spread": (q3 - q1) / 2, "round_ratios": ratios}
