"""Soak test (not in CI): train tp2 x pp2 with checkpoints, SIGKILL it at random moments, resume=auto each time,
and check that the final weights are bitwise equal to an uninterrupted run of the same config.

    python scripts/soak.py --steps 200 --every 20 --kills 3 --out soak_out [extra overrides ...]

Each kill lands once rank 0 has logged a random step after the checkpoint it resumed from, so kills hit
mid-interval, right after a save and during one alike. Exit 0 when every tensor matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
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
          "schedule.n_microbatches=4", "data.num_docs=2000", "logger=none", "train.dtype=fp32", "train.log_every=1"]


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


def logged_step(run_dir: Path) -> int:
    """The last step rank 0 logged in metrics.jsonl (train.log_every=1), 0 before any."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0


def run_with_kills(cmd: list[str], run_dir: Path, kills: int, steps: int, rng: random.Random) -> list[str]:
    """Start, SIGKILL the whole process group once a random step is logged, resume; `kills` times."""
    log = []
    for kill in range(kills):
        resumed = max(complete_steps(run_dir), default=0)
        target = rng.randint(resumed + 1, steps - 1)  # anywhere: mid-interval, right after or during a save
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        while proc.poll() is None and logged_step(run_dir) < target:
            time.sleep(0.1)  # polling a file another process writes
        if proc.poll() is not None:
            log.append(f"attempt {kill + 1} ended by itself (exit {proc.returncode}) before step {target}")
            return log
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.append(f"kill {kill + 1} at step {logged_step(run_dir)} (resumed from {resumed}); "
                   f"complete checkpoints now {complete_steps(run_dir)}")
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
    kills = run_with_kills(command(args, soaked, extra), soaked, args.kills, args.steps, random.Random(args.seed))
    for line in kills:
        print(f"soak: {line}")
    seconds = run_to_end(command(args, soaked, extra), args.timeout)
    print(f"soak: final resumed attempt: {seconds:.0f}s")
    differ = compare(reference, soaked)
    if differ:
        print(f"soak: FAIL: {len(differ)} tensors differ, e.g. {differ[:5]}")
        sys.exit(1)
    done = sum(line.startswith("kill") for line in kills)
    print(f"soak: OK: final weights bitwise equal to the uninterrupted run after {done} kills")


if __name__ == "__main__":
    main()
