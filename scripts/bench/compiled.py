"""`train.compile=true` against eager: the same Trainer, model, data and AdamW, one process and a two-process 1F1B
pipeline, at MiniMind-3's default size (768 hidden, 8 layers, vocab 6400) and at a small size; tokens/s ratio and
the compile time (the first compiled step less an eager one). Writes the "compiled" section of results.json.

Each process builds both trainers (same seed: the same weights) and runs them in turns, one step each per round
(A B A B) after a warm-up that includes the compiling first step. One process uses both cores, pp2 one each.

    python scripts/bench/compiled.py [--smoke] [--rounds N] [--warmup N] [--results PATH]
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TrainerStep, alternate, bench_parser, init_gloo, run_workers, timed, update_results  # noqa: E402

import torch  # noqa: E402

from parallel.grid import ParallelGrid  # noqa: E402
from training.config.schema import compose_config  # noqa: E402
from training.trainer import Trainer  # noqa: E402

CORES = 2  # this machine's; one process takes both, pp2 one each


@dataclass(frozen=True)
class Setup:
    """One comparison: the model (overrides), the batch, the layout and how long to measure."""

    name: str
    model: tuple[str, ...]
    pp: int
    seq: int
    micro_batch_size: int
    microbatches: int
    warmup: int
    rounds: int

    def overrides(self, compiled: bool, cache_dir: str) -> list[str]:
        return [*self.model, f"train.seq_len={self.seq}", f"train.micro_batch_size={self.micro_batch_size}",
                f"schedule.n_microbatches={self.microbatches}", f"parallel.pp={self.pp}", "schedule=1f1b",
                "train.dtype=fp32", "parallel.backend=gloo", f"train.compile={str(compiled).lower()}", "logger=none",
                "data.num_docs=400", "checkpoint.save_final=false", "optim.warmup_steps=0", f"data.cache_dir={cache_dir}"]

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch_size * self.microbatches


def worker(rank: int, world: int, setup: Setup, cache_dir: str) -> dict:
    if world > 1:
        init_gloo()
    torch.set_num_threads(max(CORES // world, 1))
    steps, first = {}, {}
    with tempfile.TemporaryDirectory() as run_root:
        for name, compiled in (("eager", False), ("compiled", True)):
            cfg = compose_config(setup.overrides(compiled, cache_dir))
            grid = ParallelGrid.build(1, 1, world, backend="gloo", timeout_s=1800)
            steps[name] = TrainerStep(Trainer(cfg, grid, Path(run_root) / name))
            first[name] = timed(steps[name])  # the compiled trainer's first step compiles its layers
        times = alternate(steps, setup.warmup, setup.rounds)
        matmul = matmul_share(steps["eager"])
    return {"times": times, "first_s": {k: v[0] for k, v in first.items()},
            "first_loss": {k: v[2] for k, v in first.items()}, "matmul_share": matmul}


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")  # BLAS work, which compiling the layers leaves as it is


def matmul_share(step: TrainerStep) -> float:
    """The share of one eager step's operator time (this process) spent in matrix multiplies and attention kernels:
    what fusing the rest can never speed up."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = prof.key_averages()
    bound = sum(e.self_cpu_time_total for e in ops if e.key in MATMULS or "scaled_dot_product" in e.key)
    return bound / sum(e.self_cpu_time_total for e in ops)


def summarize(by_rank: list[dict], setup: Setup) -> dict:
    """The row of one setup: medians, the tokens/s ratio compiled over eager, the compile time."""
    ours = by_rank[0]
    times = {name: t.summary(name) for name, t in ours["times"].items()}
    eager, compiled = times["eager"]["eager_s"], times["compiled"]["compiled_s"]
    losses = ours["first_loss"]
    return {"name": setup.name, "pp": setup.pp, **times["eager"], **times["compiled"],
            "speedup": eager / compiled, "tokens_per_s": {"eager": setup.tokens / eager,
                                                          "compiled": setup.tokens / compiled},
            "compile_s": ours["first_s"]["compiled"] - eager, "first_loss": losses,
            "matmul_share": ours["matmul_share"], "speedup_bound": 1 / ours["matmul_share"],
            "losses_close": abs(losses["eager"] - losses["compiled"]) <= 1e-5 * abs(losses["eager"]),
            "setup": asdict(setup)}


def setups(smoke: bool, warmup: int, rounds: int) -> list[Setup]:
    default = ("model=minimind3",)  # MiniMind-3's default size: 768 hidden, 8 layers, vocab 6400
    small = ("model=tiny", "model.hidden_size=256", "model.num_hidden_layers=4", "model.num_attention_heads=8",
             "model.num_key_value_heads=4", "model.intermediate_size=704")
    if smoke:
        return [Setup("tiny-one-process", ("model=tiny",), 1, 32, 1, 2, 0, 1)]
    return [Setup("default-one-process", default, 1, 256, 2, 2, warmup, rounds),
            Setup("default-pp2", default, 2, 256, 2, 4, warmup, rounds),
            Setup("small-one-process", small, 1, 256, 4, 2, warmup, rounds)]


def main(argv: list[str]) -> dict:
    parser = bench_parser(__doc__, "a tiny model, 1 round: checks the script works", rounds=4, warmup=1)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for setup in setups(args.smoke, args.warmup, args.rounds):
            rows.append(summarize(run_workers(worker, setup.pp, setup, cache, timeout=3600), setup))
            row = rows[-1]
            print(f"{setup.name}: eager {row['eager_s']:.3f} s, compiled {row['compiled_s']:.3f} s per step "
                  f"(tokens/s x{row['speedup']:.3f}); compiling took {row['compile_s']:.1f} s; matmuls and attention "
                  f"{row['matmul_share']:.1%} of an eager step; first losses "
                  f"{row['first_loss']}")
    section = {"rows": rows, "default_one_process_speedup": rows[0]["speedup"],
               "none_slower": all(r["speedup"] >= 1.0 for r in rows)}
    update_results("compiled", section, args.results)
    return section


if __name__ == "__main__":
    main(sys.argv[1:])
