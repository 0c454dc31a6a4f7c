"""`make bench`: the sleep benchmark, the real model against torch.distributed.pipelining, the single-process
overhead, the transports' hop latency, expert parallelism against replicated experts, data parallelism against
DDP (and ZeRO-1 against ZeroRedundancyOptimizer), tensor parallelism against DTensor's parallelize_module,
recomputation against torch.utils.checkpoint and compiled layers against eager, one after the other; then
bench/results.json and docs/benchmarks.md (tables, ratios, timelines).

    python scripts/bench/run_all.py [--smoke] [--results PATH] [--doc PATH] [--png-dir DIR]

Each benchmark runs in its own process (its own workers), so one cannot warm or slow the next.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, RESULTS, update_results  # noqa: E402
from report import write  # noqa: E402

HERE = Path(__file__).resolve().parent
BENCHMARKS = ("schedules.py", "vs_torch.py", "vs_torch.py --size default --pp 2", "vs_torch.py --size default --pp 4",
              "overhead.py", "hop_latency.py", "experts.py", "data_parallel.py", "tensor_parallel.py", "recompute.py",
              "compiled.py")
SMOKE_SKIPS = ("vs_torch.py --size default --pp 4",)  # the smoke checks scripts work: pp2 runs the same code


def run_benchmark(script: str, argv: list[str]) -> None:
    """One benchmark script in a process of its own (raises CalledProcessError if it fails)."""
    subprocess.run([sys.executable, str(HERE / script), *argv], check=True, cwd=ROOT)


def main(argv: list[str]) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every benchmark in its tiny mode (checks, not figures)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--png-dir", type=Path, default=ROOT / "bench" / "timelines")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.results.exists():
        args.results.unlink()  # one run's figures only
    took: dict[str, float] = {}  # entry -> seconds: where make bench's 20-minute budget goes
    for entry in (e for e in BENCHMARKS if not (args.smoke and e in SMOKE_SKIPS)):
        script, *own = entry.split()
        extra = ["--png-dir", str(args.png_dir)] if script == "schedules.py" else []
        print(f"== {entry}", flush=True)
        began = time.perf_counter()
        run_benchmark(script, [*own, "--results", str(args.results), *extra] + (["--smoke"] if args.smoke else []))
        took[entry] = time.perf_counter() - began
    update_results("run", {"command": "make bench" + (" ARGS=--smoke" if args.smoke else ""),
                            "wall_s": time.perf_counter() - start, "took_s": took,
                            "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, args.results)
    doc = write(args.results, args.doc, "make bench" + (" ARGS=--smoke" if args.smoke else ""), ROOT)
    print(f"wrote {args.results} and {doc} in {(time.perf_counter() - start) / 60:.1f} min")
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
