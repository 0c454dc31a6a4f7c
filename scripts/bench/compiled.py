"""`train.compile=true` against eager: the same Trainer, model, data and AdamW, one process and a two-process 1F1B
pipeline, at MiniMind-3's default size (768 hidden, 8 layers, vocab 6400) and at a small size; tokens/s ratio and
the compile time (the first compiled step less an eager one). Writes the "compiled" section of results.json.

Each process builds both trainers (same seed: the same weights) and runs them in turns, one step each per round
(A B, then B A) after a warm-up that includes the compiling first step. One process uses both cores, pp2 one each.

    python scripts/bench/compiled.py [--smoke] [--rounds N] [--warmup N] [--results PATH]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TrainerStep, init_gloo, run_workers  # noqa: E402
from harness import alternate, bench_parser, timed, ratio_and_spread, update_results  # noqa: E402

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

    def overrides(self, compiled: bool | str, cache_dir: str) -> list[str]:
        """The run config's overrides; `compiled` is train.compile's value (true, false or auto)."""
        value = str(compiled).lower()
        return [*self.model, f"train.seq_len={self.seq}", f"train.micro_batch_size={self.micro_batch_size}",
                f"schedule.n_microbatches={self.microbatches}", f"parallel.pp={self.pp}", "schedule=1f1b",
                "train.dtype=fp32", "parallel.backend=gloo", f"train.compile={value}", "logger=none",
                "data.num_docs=400", "checkpoint.save_final=false", "optim.warmup_steps=0",
                f"data.cache_dir={cache_dir}"]

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


# --- The size sweep's compile cells (scripts/bench/sizes.py calls measure_cells) -------------------------------

LAYOUT_PP = {"one-process": 1, "pp2": 2}


def cell_setup(cell, layout: str, warmup: int, rounds: int) -> Setup:
    """A `size_grid.Cell` as a Setup: MiniMind-3 (vocab 6400, 8 heads, 4 KV heads) at the cell's width and depth."""
    model = ("model=minimind3", f"model.hidden_size={cell.hidden}", f"model.num_hidden_layers={cell.layers}")
    return Setup(f"{cell.name}-{layout}", model, LAYOUT_PP[layout], cell.seq, cell.micro_batch_size, cell.microbatches,
                 warmup, rounds)


def cell_worker(rank: int, world: int, setup: Setup, mode: str, cache_dir: str) -> dict:
    """One setup: an eager Trainer and one with train.compile=`mode`; under `auto` the compiled trainer runs its
    compiling step and its trial (`parallel.compile.TRIAL`) first and goes on in the mode it chose; then both
    alternate (`alternate`). The step times by variant and auto's choice."""
    if world > 1:
        init_gloo()
    torch.set_num_threads(max(CORES // world, 1))
    with tempfile.TemporaryDirectory() as run_root:
        grid = ParallelGrid.build(1, 1, world, backend="gloo", timeout_s=1800)
        steps = {name: TrainerStep(Trainer(compose_config(setup.overrides(value, cache_dir)), grid,
                                           Path(run_root) / name))
                 for name, value in (("eager", False), ("compiled", mode))}
        timed(steps["eager"])
        trial, choice = steps["compiled"].trainer.compile_trial, None
        wall = timed(steps["compiled"])[0]  # compiles the layers
        if trial is not None:
            choice = trial.after_step(wall)
            while choice is None:
                choice = trial.after_step(timed(steps["compiled"])[0])
        times = alternate(steps, setup.warmup, setup.rounds)
    return {"times": times, "choice": None if choice is None else ("compiled" if choice.compiled else "eager"),
            "trial": None if choice is None else {"compiled_s": choice.compiled_s, "eager_s": choice.eager_s}}


def measure_cells(cells: list, layouts: tuple[str, ...] = ("one-process", "pp2"), warmup: int = 1, rounds: int = 5,
                  mode: str = "auto", timeout: float = 7200, cache: str | None = None) -> list[dict]:
    """Compiled against eager at each `size_grid.Cell` and layout ("one-process": both cores; "pp2": a 1F1B pipeline,
    one core per rank), with train.compile=`mode` ("auto" or "true") on the compiled side. One spawn per layout and cell
    (an eager and a compiled Trainer, same seed and data); after the compiling step (and auto's
    trial) the two alternate one step each per round, in reverse order every other round (A B B A), for `warmup`
    + `rounds` rounds.

    One dict per cell and layout: "cell" (its name), "hidden", "layers", "seq", "micro_batch_size", "layout", "mode",
    "ratio" (the median over rounds of compiled_s / eager_s of that round: below 1 = compiled faster), "spread" (the
    measured noise of the ratio: half the interquartile range of the per-round ratios), "eager_s" and "compiled_s"
    (median wall seconds per step, slowest rank), "choice" (auto's: "compiled" or "eager"; None under "true") and
    "trial" (the summed step times auto chose from; None under "true"). `cache`: the tokenized data's folder (a
    shared one spares a later call the tokenizing; by default a fresh one, removed after)."""
    rows = []
    with tempfile.TemporaryDirectory() as fresh:
        cache = cache or fresh
        for layout in layouts:
            setups = [cell_setup(cell, layout, warmup, rounds) for cell in cells]
            # Each cell in fresh processes (as a user's run of one size is): variants built after other cells' in
            # the same processes carry their heap's history (dp2 / DDP at h256-l8: 1.06-1.11x after eleven cells,
            # 0.96-1.03x alone).
            measured = [run_workers(cell_worker, LAYOUT_PP[layout], setup, mode, cache, timeout=timeout)[0]
                        for setup in setups]
            for cell, got in zip(cells, measured):
                compiled, eager = got["times"]["compiled"].wall, got["times"]["eager"].wall
                rows.append({"cell": cell.name, "hidden": cell.hidden, "layers": cell.layers, "seq": cell.seq,
                             "micro_batch_size": cell.micro_batch_size, "layout": layout, "mode": mode,
                             **ratio_and_spread(compiled, eager), "eager_s": statistics.median(eager),
                             "compiled_s": statistics.median(compiled), "choice": got["choice"],
                             "trial": got["trial"]})
    return rows


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
