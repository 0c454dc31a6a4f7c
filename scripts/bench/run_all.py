"""`make bench`: the sleep benchmark, the real model against torch.distributed.pipelining, the single-process
overhead, rollout decoding against transformers' generate, the transports' hop latency, expert parallelism against
replicated experts, data parallelism against DDP (and ZeRO-1 against ZeroRedundancyOptimizer), sharded data
parallelism (zero 0-3 memory per rank, zero=3 against a `fully_shard` loop), tensor parallelism
against DTensor's parallelize_module, recomputation against torch.utils.checkpoint, compiled layers against eager,
and the size sweep's quick cells (scripts/bench/sizes.py --quick), one after the other; then bench/results.json and
docs/benchmarks.md (tables, ratios, timelines, the sizes heat map). `--sizes` runs the size sweep alone over every
cell (`make bench ARGS=--sizes`), keeping the other sections of results.json, and rewrites the page.

    python scripts/bench/run_all.py [--smoke] [--sizes] [--results PATH] [--doc PATH] [--png-dir DIR] [--heat-map PATH]

Each benchmark runs in its own process (its own workers), so one cannot warm or slow the next.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT  # noqa: E402
from harness import RESULTS, update_results  # noqa: E402
from report import write  # noqa: E402

HERE = Path(__file__).resolve().parent
BENCHMARKS = ("schedules.py", "vs_torch.py", "vs_torch.py --size default --pp 2", "vs_torch.py --size default --pp 4",
              "overhead.py", "rollout.py", "hop_latency.py", "experts.py", "data_parallel.py", "fsdp.py",
              "tensor_parallel.py", "recompute.py",
              "compiled.py", "sizes.py --quick --rounds 4")
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
    parser.add_argument("--sizes", action="store_true", help="the size sweep alone, every cell (hours on 2 cores)")
    parser.add_argument("--heat-map", type=Path, default=ROOT / "bench" / "sizes.png", help="the size sweep's PNG")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.results.exists() and not args.sizes:
        args.results.unlink()  # one run's figures only
    took: dict[str, float] = {}  # entry -> seconds: where make bench's 20-minute budget goes
    entries = ["sizes.py"] if args.sizes else [e for e in BENCHMARKS if not (args.smoke and e in SMOKE_SKIPS)]
    for entry in entries:
        script, *own = entry.split()
        extra = {"schedules.py": ["--png-dir", str(args.png_dir)], "sizes.py": ["--png", str(args.heat_map)]}.get(
            script, [])
        print(f"== {entry}", flush=True)
        began = time.perf_counter()
        run_benchmark(script, [*own, "--results", str(args.results), *extra] + (["--smoke"] if args.smoke else []))
        took[entry] = time.perf_counter() - began
    command = "make bench" + (" ARGS=--smoke" if args.smoke else " ARGS=--sizes" if args.sizes else "")
    if not args.sizes:  # the sweep alone leaves the whole run's record as it was
        update_results("run", {"command": command, "wall_s": time.perf_counter() - start, "took_s": took,
                                "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, args.results)
    doc = write(args.results, args.doc, json.loads(args.results.read_text()).get("run", {}).get("command", command),
                ROOT)
    print(f"wrote {args.results} and {doc} in {(time.perf_counter() - start) / 60:.1f} min")
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
