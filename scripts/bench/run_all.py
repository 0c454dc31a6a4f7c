"""Side-by-side benchmarks: each variant trains the same model and batch; runs alternate A, B, A, B, ...

Prints the median step time of every variant and its ratio to the first one. The machines are noisy, so
variants are interleaved round by round and the first two steps of every run (warm-up) are dropped.
Usage: python scripts/bench/run_all.py [--rounds N] [extra Hydra overrides for every variant]
"""

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["model=tiny", "model.num_hidden_layers=8", "model.hidden_size=128", "train.seq_len=64",
          "train.micro_batch_size=4", "schedule.n_microbatches=8", "train.steps=8", "logger=none",
          "train.log_every=1", "data.num_docs=1000"]
VARIANTS = {
    "1 process (grad accumulation)": [],
    "pp2 gpipe": ["parallel.pp=2", "schedule=gpipe"],
    "pp2 1f1b": ["parallel.pp=2", "schedule=1f1b"],
    "pp2 zb-h1": ["parallel.pp=2", "schedule=zb-h1"],
}
WARMUP_STEPS = 2


def step_times(overrides: list[str], run_dir: Path) -> list[float]:
    """Train once and return the per-step times after warm-up."""
    cmd = [sys.executable, "train.py", *COMMON, *overrides, f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records[WARMUP_STEPS:]]


def main(argv: list[str]) -> None:
    rounds = 3
    if argv[:1] == ["--rounds"]:
        rounds, argv = int(argv[1]), argv[2:]
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for i, (name, overrides) in enumerate(VARIANTS.items()):
                times[name] += step_times([*overrides, *argv], Path(tmp) / f"{r}-{i}")
    base = statistics.median(times[next(iter(VARIANTS))])
    print(f"{'variant':34s} {'median step (s)':>16s} {'ratio':>7s}   ({rounds} alternating rounds)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:34s} {median:16.4f} {median / base:7.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
