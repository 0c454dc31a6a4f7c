"""Soak test (not in CI): train tp2 x pp2 with checkpoints, SIGKILL it at random moments, resume=auto each time,
and check that the final weights are bitwise equal to an uninterrupted run of the same config.

    python scripts/soak.py --steps 200 --every 20 --kills 3 --out soak_out [extra overrides ...]

Each kill lands a random 0.5-3 checkpoint intervals after the attempt started (or the previous kill), so it
hits mid-step, mid-save and between saves alike. Exit 0 when every tensor matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUT = ["model=tiny", "parallel.tp=2", "parallel.pp=2", "train.seq_len=32", "train.micro_batch_size=2",
          "schedule.n_microbatches=4", "data.num_docs=2000", "logger=none", "train.dtype=fp32", "train.log_every=10"]


def command(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> list[str]:
    """train.py for this soak: the fixed layout, checkpoints every `every` steps into the run directory."""
    return [sys.executable, "train.py", *LAYOUT, f"train.steps={args.steps}", f"checkpoint.every={args.every}",
            "checkpoint.resume=auto", f"checkpoint.dir={run_dir / 'checkpoints'}", "checkpoint.keep_last=2",
            f"data.cache_dir={args.out / 'cache'}", f"hydra.run.dir={run_dir}", *extra]


def complete_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints in the run's checkpoint folder."""
    from checkpoint.manager import complete_checkpoints

    return [int(p.name.split("_")[-1]) for p in complete_checkpoints(run_dir / "checkpoints")]


def run_to_end(cmd: list[str], timeout: float) -> float:
    """Run a command to completion (its own process group); return its seconds; fail loudly on error."""
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"soak: {' '.join(cmd[:2])} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return time.monotonic() - start


def run_with_kills(cmd: list[str], run_dir: Path, kills: int, rng: random.Random, interval_s: float) -> list[str]:
    """Start, SIGKILL the whole process group at a random moment, resume; `kills` times. Returns a log."""
    log = []
    for kill in range(kills):
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        delay = rng.uniform(0.5, 3.0) * interval_s
        try:
            proc.wait(timeout=delay)
            log.append(f"attempt {kill + 1}: finished before its kill at {delay:.1f}s")
            return log
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.append(f"kill {kill + 1} after {delay:.1f}s; complete checkpoints {complete_steps(run_dir)}")
    return log


def compare(reference: Path, soaked: Path) -> list[str]:
    """Names of tensors that differ (bitwise) between the final checkpoints of two runs."""
    from checkpoint.export import read_training_weights

    ref, _ = read_training_weights(reference / "checkpoints")
    got, _ = read_training_weights(soaked / "checkpoints")
    import torch

    return sorted(set(ref) ^ set(got)) + [k for k in ref if k in got and not torch.equal(ref[k], got[k])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed for one uninterrupted run")
    parser.add_argument("--out", type=Path, default=Path("soak_out"))
    args, extra = parser.parse_known_args()
    args.out = args.out.resolve()
    reference, soaked = args.out / "reference", args.out / "soaked"
    seconds = run_to_end(command(args, reference, extra), args.timeout)
    print(f"soak: uninterrupted run of {args.steps} steps: {seconds:.0f}s")
    interval_s = seconds * args.every / args.steps  # wall time of one checkpoint interval
    for line in run_with_kills(command(args, soaked, extra), soaked, args.kills, random.Random(args.seed),
                               interval_s):
        print(f"soak: {line}")
    seconds = run_to_end(command(args, soaked, extra), args.timeout)
    print(f"soak: final resumed attempt: {seconds:.0f}s")
    differ = compare(reference, soaked)
    if differ:
        print(f"soak: FAIL: {len(differ)} tensors differ, e.g. {differ[:5]}")
        sys.exit(1)
    print(f"soak: OK: final weights bitwise equal to the uninterrupted run after {args.kills} kills")


if __name__ == "__main__":
    main()
