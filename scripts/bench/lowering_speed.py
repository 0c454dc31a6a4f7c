"""Time lowering a pipeline before launch (generate, lower, verify, simulate) at pp=8, m=64 and pp=64, m=1024.

    python scripts/bench/lowering_speed.py [--repeat 3] [--sizes 8x64 64x1024]

Prints, per schedule and size, the number of lowered actions and the best of `--repeat` runs of each phase,
as CPU seconds of this process (what the code costs, whatever else the machine runs) and wall seconds.
Lowering is what a run pays before its first step (lower_pipeline: generate + lower + verify, then the
simulated step the trace is drawn against); `lower+verify+simulate` adds up the three public functions, as a
caller runs them: `simulate` is handed what `verify` returned, so it does not repeat the static check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harness import repeated  # noqa: E402
from parallel.pipeline.lowered import lower_pipeline  # noqa: E402
from parallel.pipeline.lowering import lower  # noqa: E402
from parallel.pipeline.schedules import SCHEDULES  # noqa: E402
from parallel.pipeline.simulate import simulate, verify  # noqa: E402
from parallel.spec import PipelineSpec  # noqa: E402


def best_of(repeat: int, fn) -> tuple[float, float, object]:
    """The shortest CPU and wall times of `repeat` runs of fn(), and its last result."""
    times, result = repeated(fn, repeat)
    return min(times.cpu), min(times.wall), result


def bench(name: str, vpp: int, pp: int, m: int, repeat: int) -> str:
    """One line of figures for a schedule at one size: CPU seconds per phase, then totals as cpu/wall."""
    registered = SCHEDULES[name]
    n = pp * vpp
    compute = registered.generate(pp, m, vpp)
    lower_cpu, lower_wall, lowered = best_of(repeat, lambda: lower(compute, pp, n, registered.placement))
    verify_cpu, verify_wall, verified = best_of(repeat, lambda: verify(lowered, pp, n, m, registered.placement))
    sim_cpu, sim_wall, _ = best_of(repeat, lambda: simulate(verified, pp, n, m, registered.placement))
    pipeline = PipelineSpec(pp=pp, vpp=vpp, schedule=name, n_microbatches=m)
    layers = iter(range(n, n + repeat))  # a new model depth per run: a new cache key, so the work is timed
    checks_cpu, checks_wall, _ = best_of(repeat, lambda: lower_pipeline(pipeline, next(layers)).simulate())
    total_cpu, total_wall = lower_cpu + verify_cpu + sim_cpu, lower_wall + verify_wall + sim_wall
    return (f"{name:<17} pp={pp:<3} m={m:<5} actions={sum(map(len, lowered)):<7} cpu: "
            f"lower {lower_cpu:.3f}s verify {verify_cpu:.3f}s simulate {sim_cpu:.3f}s | lower+verify+simulate "
            f"{total_cpu:.3f}s cpu / {total_wall:.3f}s wall | lowering {checks_cpu:.3f}s cpu / {checks_wall:.3f}s wall")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per phase; the best is printed")
    parser.add_argument("--sizes", nargs="+", default=["8x64", "64x1024"], help="PPxM, e.g. 8x64 64x1024")
    args = parser.parse_args(argv)
    for size in args.sizes:
        pp, m = (int(x) for x in size.split("x"))
        for name, registered in SCHEDULES.items():
            print(bench(name, registered.default_vpp, pp, m, args.repeat), flush=True)


if __name__ == "__main__":
    main()
