"""Layout search accuracy: predicted against measured step time of several two-process layouts, and what layout=auto picks.

The model is 8 layers x hidden 256 at seq 128, fp32, gloo, at a fixed global batch. Each candidate runs as
`python train.py <its overrides>` for a few steps; rounds alternate the candidates (A B C ... A B C ...) so
that a noisy neighbour slows all of them alike; the median step time after the warm-up steps is compared
with `predict` on the costs measured for this shape (scripts/profile_costs.py's cache). Prints the table, the
Spearman rank correlation, the largest relative error and layout=auto's choice against the fastest measured.

    python scripts/bench/layout_search_accuracy.py [--rounds 2] [--steps 6] [--warmup 2] [--results PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT  # noqa: E402
from harness import update_results  # noqa: E402

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

from training.config import CONF_DIR, register_schema  # noqa: E402
from training.layout_search.predict import Candidate, predict  # noqa: E402
from training.layout_search.profile import measured_costs  # noqa: E402
from training.layout_search.search import search  # noqa: E402
from training.layout_search.search_report import short  # noqa: E402

WORLD = 2
MODEL = ["model=tiny", "model.num_hidden_layers=8", "model.hidden_size=256", "model.name=bench8x256"]
BASE = [*MODEL, "train.seq_len=128", "train.dtype=fp32", "parallel.backend=gloo", "train.micro_batch_size=2",
        "schedule.n_microbatches=8", "logger=none", "data.num_docs=400", "checkpoint.save_final=false",
        "train.log_every=1", "optim.warmup_steps=0"]
PP2 = Candidate(dp=1, tp=1, pp=2, vpp=1, schedule="1f1b", n_microbatches=8, micro_batch_size=2, recompute="none")
# Schedules, micro-batch counts at the same global batch (16 sequences), partitions, and dp2 vs pp2 vs tp2.
CANDIDATES = [
    PP2,
    replace(PP2, schedule="gpipe"),
    replace(PP2, schedule="zb-h1"),
    replace(PP2, n_microbatches=16, micro_batch_size=1),
    replace(PP2, n_microbatches=4, micro_batch_size=4),
    replace(PP2, layers_per_stage=(5, 3)),
    replace(PP2, pp=1, dp=2, n_microbatches=4),
    replace(PP2, pp=1, tp=2),
]


def compose_cfg(cache_dir: Path):
    """The benchmark's run config (the shape the costs are measured at)."""
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*BASE, f"data.cache_dir={cache_dir}"])
    GlobalHydra.instance().clear()
    return cfg


def run_once(candidate: Candidate, steps: int, warmup: int, cache_dir: Path, out: Path) -> list[float]:
    """Launch train.py with the candidate's overrides; its step times after the warm-up (rank 0's metrics)."""
    run_dir = out / f"run{time.monotonic_ns()}"
    cmd = [sys.executable, "train.py", *BASE, *candidate.overrides(), f"train.steps={steps}",
           f"data.cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{short(candidate)} failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records if r["step"] > warmup]


def measure_all(candidates: list[Candidate], rounds: int, steps: int, warmup: int, cache_dir: Path,
                out: Path) -> dict[Candidate, float]:
    """Median measured step time of each candidate, runs alternated round by round."""
    times: dict[Candidate, list[float]] = {c: [] for c in candidates}
    for r in range(rounds):
        for c in candidates:
            times[c] += run_once(c, steps, warmup, cache_dir, out)
            print(f"  round {r + 1}: {short(c)}: {statistics.median(times[c]):.4f} s so far", flush=True)
    return {c: statistics.median(t) for c, t in times.items()}


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's on the ranks (scipy is not a dependency; this is all it takes)."""
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def report(candidates: list[Candidate], predicted: dict, measured: dict, auto: Candidate) -> dict:
    """Print the table and the summary figures; return them for results.json."""
    rows = []
    print(f"{'candidate':<62} {'predicted s':>11} {'measured s':>11} {'error':>7} {'peak MiB':>9}")
    for c in candidates:
        p, m = predicted[c], measured[c]
        rows.append({"candidate": short(c), "predicted_s": p.step_s, "measured_s": m,
                     "rel_error": (p.step_s - m) / m, "peak_bytes": max(p.peak_bytes)})
        print(f"{short(c):<62} {p.step_s:>11.4f} {m:>11.4f} {(p.step_s - m) / m:>+7.1%} "
              f"{max(p.peak_bytes) / 2**20:>9.1f}{'  <- layout=auto' if c == auto else ''}")
    line1 = [c for c in candidates if c in CANDIDATES]
    rho = spearman([predicted[c].step_s for c in line1], [measured[c] for c in line1])
    worst = max(abs(predicted[c].step_s - measured[c]) / measured[c] for c in line1)
    fastest = min(line1, key=measured.__getitem__)
    gap = measured[auto] / measured[fastest] - 1
    print(f"spearman {rho:.3f} over {len(line1)} candidates; max relative error {worst:.1%}")
    print(f"layout=auto picks {short(auto)}: measured {measured[auto]:.4f} s, fastest measured {short(fastest)} "
          f"{measured[fastest]:.4f} s ({gap:+.1%})")
    return {"rows": rows, "spearman": rho, "max_rel_error": worst, "auto": short(auto),
            "auto_vs_fastest": gap, "fastest": short(fastest)}


def main() -> int:
    """Profile, predict, measure alternately, compare."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--results", type=Path, default=None, help="write the figures into this results.json")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = Path(tmp) / "cache"
        cfg = compose_cfg(cache_dir)
        costs = measured_costs(cfg, WORLD)
        auto = search(cfg, WORLD, costs).best.candidate
        candidates = CANDIDATES + ([auto] if auto not in CANDIDATES else [])
        predicted = {c: predict(c, cfg, costs) for c in candidates}
        print(f"measuring {len(candidates)} candidates x {args.rounds} rounds of {args.steps} steps "
              f"(first {args.warmup} skipped)", flush=True)
        measured = measure_all(candidates, args.rounds, args.steps, args.warmup, cache_dir, Path(tmp))
    figures = report(candidates, predicted, measured, auto)
    print(f"total {time.monotonic() - started:.0f} s")
    if args.results:
        update_results("layout_search_accuracy", figures, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
