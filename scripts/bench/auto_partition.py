"""Acceptance: with a 32k vocabulary, `parallel.layers_per_stage=auto` beats the even split at pp=2.

    python scripts/bench/auto_partition.py [--rounds 7] [--microbatches 8]

Profiles the model (or reads the cached costs), lets the cost model choose the split, then runs the even and the
chosen split alternated on two gloo processes (engine step + AdamW) and prints medians, the ratios and the
cost model's predictions for both. On a loaded machine the wall time follows the total work (the same for both
splits), so the busiest rank's CPU time is printed too: the critical path on a quiet machine."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, run_workers  # noqa: E402
from harness import alternate  # noqa: E402

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

from parallel.engine import build_engine  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from parallel.spec import PipelineSpec  # noqa: E402
from training.specs import default_engine_spec  # noqa: E402
from parallel.step import MicroBatch  # noqa: E402
from training.config import CONF_DIR, register_schema  # noqa: E402
from training.config.validate import validate  # noqa: E402
from training.layout_search.predict import candidate_of, predict  # noqa: E402
from training.layout_search.profile import measured_costs  # noqa: E402
from training.trainer import build_model  # noqa: E402

MODEL = ["model.num_hidden_layers=8", "model.hidden_size=256", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.vocab_size=32000", "train.seq_len=128", "train.micro_batch_size=4",
         "train.dtype=fp32", "parallel.pp=2", "logger=none", f"data.cache_dir={ROOT / '.cache' / 'sluice'}"]


def config(overrides: list[str], base: list[str] = MODEL):
    """The run config train.py would compose from `base` and `overrides` (validated: `auto` resolved)."""
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*base, *overrides])
    validate(cfg)
    return cfg


def worker(rank: int, world: int, cfg_by_name: dict, rounds: int) -> dict | None:
    """Both splits on the same weights and batches, alternated; rank 0 returns the step times."""
    grid = ParallelGrid.build(dp=1, tp=1, pp=2, backend="gloo", timeout_s=300)
    steps = {}
    for name, cfg in cfg_by_name.items():
        model, weights = build_model(cfg)
        spec = default_engine_spec(PipelineSpec(pp=2, schedule=cfg.schedule.name, n_microbatches=cfg.schedule.n_microbatches,
                                       layers_per_stage=tuple(cfg.parallel.layers_per_stage or ()) or None),
                          cfg.train.micro_batch_size, cfg.train.seq_len)
        engine = build_engine(spec, model, grid, weights)
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1)
        micro = [MicroBatch(ids, ids.clone()) for ids in torch.randint(
            0, engine.stages[next(iter(engine.stages))].chunk.config.vocab_size, (cfg.schedule.n_microbatches, cfg.train.micro_batch_size, cfg.train.seq_len),
            generator=gen)]
        steps[name] = lambda e=engine, o=optimizer, m=micro: (e.step(m), o.step(), o.zero_grad(set_to_none=True))
    times = alternate(steps, 1, rounds, busiest=True)  # one warm-up step each
    return {name: {"wall": t.wall, "cpu": t.cpu} for name, t in times.items()} if rank == 0 else None


def main(argv: list[str]) -> int:
    """Profile, choose, measure both splits; print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args(argv)
    m = f"schedule.n_microbatches={args.microbatches}"
    even = config([m])
    costs = measured_costs(even, world_size=2)  # cached: `auto` below balances measured costs
    auto = config([m, "parallel.layers_per_stage=auto"])
    chosen = list(auto.parallel.layers_per_stage)
    times = run_workers(worker, 2, {"even": even, "auto": auto}, args.rounds, timeout=1800)[0]
    med = {name: {what: statistics.median(v) for what, v in t.items()} for name, t in times.items()}
    for name, cfg in (("even", even), ("auto", auto)):
        predicted = predict(candidate_of(cfg), cfg, costs).step_s
        split = list(cfg.parallel.layers_per_stage) if cfg.parallel.layers_per_stage else [4, 4]
        print(f"{name:<5} layers {split}: measured median {med[name]['wall']:.3f} s wall (runs "
              f"{', '.join(f'{t:.2f}' for t in times[name]['wall'])}), busiest rank's CPU {med[name]['cpu']:.3f} s; "
              f"predicted {predicted:.3f} s")
    print(f"auto chose {chosen}; auto / even: wall {med['auto']['wall'] / med['even']['wall']:.3f}, "
          f"busiest rank's CPU {med['auto']['cpu'] / med['even']['cpu']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
