"""Time the pre-launch plan checks (generate, lower, verify, simulate) at pp=8, m=64 and pp=64, m=1024.

    python scripts/bench/plan_checks.py [--repeat 3] [--sizes 8x64 64x1024]

Prints, per schedule and size, the number of lowered actions and the best of `--repeat` runs of each phase.
`checks` is what a run pays before its first step (plan_pipeline: generate + lower + verify, then the
simulated step the trace is drawn against); `lower+verify+simulate` times the three public functions alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from parallel.pipeline.lowering import lower  # noqa: E402
from parallel.pipeline.plan import plan_pipeline  # noqa: E402
from parallel.pipeline.schedules import SCHEDULES  # noqa: E402
from parallel.pipeline.simulate import simulate, verify  # noqa: E402
from parallel.spec import PipelineSpec  # noqa: E402

CASES = (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2))


def best_of(repeat: int, fn) -> tuple[float, object]:
    """The shortest of `repeat` runs of fn() and its last result."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def bench(name: str, vpp: int, pp: int, m: int, repeat: int) -> str:
    """One line of figures for a schedule at one size."""
    spec = SCHEDULES[name]
    n = pp * vpp
    t_gen, compute = best_of(repeat, lambda: spec.generate(pp, m, vpp))
    t_lower, lowered = best_of(repeat, lambda: lower(compute, pp, n, spec.placement))
    t_verify, _ = best_of(repeat, lambda: verify(lowered, pp, n, m, spec.placement))
    t_sim, _ = best_of(repeat, lambda: simulate(lowered, pp, n, m, spec.placement))
    pipeline = PipelineSpec(pp=pp, vpp=vpp, schedule=name, n_microbatches=m)

    layers = iter(range(n, n + repeat))  # a new model depth per run: a new cache key, so the work is timed

    def checks():
        return plan_pipeline(pipeline, next(layers)).simulate()

    t_checks, _ = best_of(repeat, checks)
    actions = sum(map(len, lowered))
    return (f"{name:<17} pp={pp:<3} m={m:<5} actions={actions:<7} generate {t_gen:6.3f}s  lower {t_lower:6.3f}s  "
            f"verify {t_verify:6.3f}s  simulate {t_sim:6.3f}s  lower+verify+simulate {t_lower + t_verify + t_sim:6.3f}s"
            f"  checks {t_checks:6.3f}s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per phase; the best is printed")
    parser.add_argument("--sizes", nargs="+", default=["8x64", "64x1024"], help="PPxM, e.g. 8x64 64x1024")
    args = parser.parse_args(argv)
    for size in args.sizes:
        pp, m = (int(x) for x in size.split("x"))
        for name, vpp in CASES:
            print(bench(name, vpp, pp, m, args.repeat), flush=True)


if __name__ == "__main__":
    main()
