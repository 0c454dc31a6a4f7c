"""Soak test (not in CI): one run with train.max_restarts survives SIGKILLs of random workers at random times, and
its per-step losses and final weights equal an uninterrupted run of the same config bit for bit.

    python scripts/soak.py --steps 60 --every 5 --kills 5 --out soak_out [extra overrides ...]

The run is started once; the script kills a random worker (a child of the launcher) once rank 0 has logged a
random step, waits for the group to restart from its newest checkpoint, and kills again, `kills` times. Exit 0
when the run ended with exit 0 and every loss and tensor matches, 1 otherwise.
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
    """train.py for this soak: the fixed layout, checkpoints every `every` steps, restarts allowed."""
    return [sys.executable, "train.py", *LAYOUT, f"train.steps={args.steps}", f"checkpoint.every={args.every}",
            f"train.max_restarts={args.max_restarts}", "checkpoint.keep_last=2",
            f"data.cache_dir={args.out / 'cache'}", f"hydra.run.dir={run_dir}", *extra]


def run_to_end(cmd: list[str], timeout: float) -> float:
    """Run a command to completion; return its seconds; fail loudly on error."""
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


def workers(launcher: int) -> dict[int, int]:
    """Global rank -> pid of the launcher's live worker processes (their RANK in the environment)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] == "Z" or int(fields[1]) != launcher:
                continue
            env = dict(v.split(b"=", 1) for v in (entry / "environ").read_bytes().split(b"\0") if b"=" in v)
        except (OSError, ValueError):
            continue
        if b"RANK" in env and b"LOCAL_RANK" in env:
            found[int(env[b"RANK"])] = int(entry.name)
    return found


def run_with_kills(cmd: list[str], run_dir: Path, kills: int, steps: int, world: int, rng: random.Random,
                   timeout: float) -> tuple[int, list[str], str]:
    """Start the run once; SIGKILL a random worker at `kills` random steps, each after the group restarted."""
    log = []
    targets = sorted(rng.sample(range(2, steps - 1), kills))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    previous: set[int] = set()
    for target in targets:
        while proc.poll() is None and time.monotonic() < deadline:
            alive = workers(proc.pid)
            if len(alive) == world and not previous & set(alive.values()) and logged_step(run_dir) >= target:
                break  # a fresh group (after the last kill's restart) that reached the target step
            time.sleep(0.05)  # polling files another process writes
        if proc.poll() is not None or time.monotonic() >= deadline:
            break
        time.sleep(rng.uniform(0, 0.3))  # anywhere in the step: compute, P2P, all-reduce or a save
        rank, pid = rng.choice(sorted(workers(proc.pid).items()))
        previous = set(workers(proc.pid).values())
        os.kill(pid, signal.SIGKILL)
        log.append(f"killed rank {rank} (pid {pid}) at step {logged_step(run_dir)}")
    _, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    return proc.returncode, log, stderr


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss; a step trained again after a restart keeps its last record."""
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def compare(reference: Path, soaked: Path) -> list[str]:
    """Names of tensors that differ (bitwise) between the final checkpoints of two runs."""
    from checkpoint.export import read_training_weights

    ref, _ = read_training_weights(reference / "checkpoints")
    got, _ = read_training_weights(soaked / "checkpoints")
    import torch

    return sorted(set(ref) ^ set(got)) + [k for k in ref if k in got and not torch.equal(ref[k], got[k])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--max-restarts", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed for each run")
    parser.add_argument("--out", type=Path, default=Path("soak_out"))
    args, extra = parser.parse_known_args()
    args.out = args.out.resolve()
    reference, soaked = args.out / "reference", args.out / "soaked"
    seconds = run_to_end(command(args, reference, extra), args.timeout)
    print(f"soak: uninterrupted run of {args.steps} steps: {seconds:.0f}s")
    start = time.monotonic()
    code, kills, stderr = run_with_kills(command(args, soaked, extra), soaked, args.kills, args.steps, 4,
                                         random.Random(args.seed), args.timeout)
    for line in kills:
        print(f"soak: {line}")
    for line in (part for row in stderr.splitlines() for part in row.split("\r")):  # a bar shares the line
        if line.startswith("sluice: ") and "restart" in line:
            print(f"soak: run said: {line}")
    print(f"soak: run with {len(kills)} kills ended with exit {code} after {time.monotonic() - start:.0f}s")
    differ = compare(reference, soaked)
    same_losses = losses(reference) == losses(soaked)
    if code != 0 or differ or not same_losses or len(kills) < args.kills:
        print(f"soak: FAIL: exit {code}, {len(kills)} kills, losses {'equal' if same_losses else 'differ'}, "
              f"{len(differ)} tensors differ {differ[:5]}")
        sys.exit(1)
    print(f"soak: OK: {args.steps} per-step losses and the final weights bitwise equal to the uninterrupted run "
          f"after {len(kills)} kills")


if __name__ == "__main__":
    main()
