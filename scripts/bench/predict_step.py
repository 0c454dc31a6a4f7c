"""Predicted against measured step time for layouts of two processes at one global batch (acceptance 1 of the
planner: rank correlation and relative error), on the model 8 layers x hidden 256, seq 128, fp32, gloo.

    python scripts/bench/predict_step.py [--rounds 5]

Profiles the shape (or reads the cached costs), then runs every layout's step (engine + AdamW) alternated on
two gloo processes, and prints each layout's median against its prediction and the Spearman correlation. Run
it on a quiet machine: with other load the wall time follows the total work, not the layout's critical path."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from auto_partition import MODEL, alternated, config  # noqa: E402
from common import run_workers  # noqa: E402

import torch  # noqa: E402

from parallel.engine import build_engine  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from parallel.step import MicroBatch  # noqa: E402
from training.planner.predict import candidate_of, predict  # noqa: E402
from training.planner.profile import measured_costs  # noqa: E402
from training.specs import engine_spec  # noqa: E402
from training.trainer import build_model  # noqa: E402

SHAPE = [o for o in MODEL if not o.startswith(("model.vocab_size", "parallel.pp"))]  # vocab 6400
LAYOUTS = {  # 32 sequences per step in every layout
    "pp2 1f1b m8": ["parallel.pp=2", "schedule=1f1b", "schedule.n_microbatches=8"],
    "pp2 gpipe m8": ["parallel.pp=2", "schedule=gpipe", "schedule.n_microbatches=8"],
    "pp2 zb-h1 m8": ["parallel.pp=2", "schedule=zb-h1", "schedule.n_microbatches=8"],
    "pp2 1f1b m4 b8": ["parallel.pp=2", "schedule=1f1b", "schedule.n_microbatches=4", "train.micro_batch_size=8"],
    "pp2 1f1b [5,3]": ["parallel.pp=2", "schedule=1f1b", "schedule.n_microbatches=8",
                       "parallel.layers_per_stage=[5,3]"],
    "dp2 m4": ["parallel.dp=2", "schedule.n_microbatches=4"],
    "tp2 m8": ["parallel.tp=2", "schedule.n_microbatches=8"],
}


def worker(rank: int, world: int, cfgs: dict, rounds: int) -> dict | None:
    """Every layout's step on one process group, alternated; rank 0 returns the times."""
    steps = {}
    for name, cfg in cfgs.items():
        p = cfg.parallel
        grid = ParallelGrid.build(p.dp, p.tp, p.pp, backend="gloo", timeout_s=300)
        model, weights = build_model(cfg)
        engine = build_engine(engine_spec(cfg, grid.device), model, grid, weights)
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.schedule.n_microbatches, cfg.train.micro_batch_size,
                                                      cfg.train.seq_len), generator=torch.Generator().manual_seed(1))
        micro = [MicroBatch(x, x.clone()) for x in ids]
        steps[name] = lambda e=engine, o=optimizer, m=micro: (e.step(m), o.step(), o.zero_grad(set_to_none=True))
    times = alternated(steps, rounds)
    return times if rank == 0 else None


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (no ties expected)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        return [order.index(i) for i in range(len(v))]
    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main(argv: list[str]) -> int:
    """Profile, run every layout, print measured against predicted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    cfgs = {name: config(extra, base=SHAPE) for name, extra in LAYOUTS.items()}
    predicted = {}
    for name, cfg in cfgs.items():
        costs = measured_costs(cfg, world_size=2)
        predicted[name] = predict(candidate_of(cfg), cfg, costs).step_s
    times = run_workers(worker, 2, cfgs, args.rounds, timeout=3000)[0]
    measured = {name: statistics.median(t["wall"]) for name, t in times.items()}
    for name in LAYOUTS:
        print(f"{name:<16} measured {measured[name]:7.3f} s  predicted {predicted[name]:7.3f} s "
              f"({predicted[name] / measured[name] - 1:+.0%})")
    names = list(LAYOUTS)
    print(f"Spearman {spearman([measured[n] for n in names], [predicted[n] for n in names]):.2f}; worst error "
          f"{max(abs(predicted[n] / measured[n] - 1) for n in names):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
