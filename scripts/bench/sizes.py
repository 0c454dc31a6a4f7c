"""The size sweep: every comparison Sluice makes with a peer, at each model size of `size_grid` (issue 39): compiled
layers (`train.compile=auto`) against eager in one process and in a pp2 pipeline, dp2 against DDP, zero1 against DDP
with ZeroRedundancyOptimizer. Writes the "sizes" section of results.json and a heat map PNG of the ratios.

Each cell's two variants run in the same processes (fresh ones for each cell), one step each per round (A B, then B A)
after a warm-up; a cell's ratio is the median of the per-round ratios Sluice / peer (below 1: Sluice faster) and its
spread half their interquartile range. `--launches K` measures each side K times over, each launch in fresh processes
with freshly built models, and pools their rounds: a variant built in a process keeps a speed of its own for the
process's life (memory placement), so one launch's median moves from launch to launch more than its rounds' spread says
(dp2 / DDP at h256-l8: 1.06, 0.98, 1.03, 1.04 and 0.99 in five launches), and more rounds in one launch cannot average
that out. `--quick` measures `size_grid.QUICK` (the default `make bench`), no option every cell (`make bench
ARGS=--sizes`); `--only compile|dp` measures one side and keeps the other's columns from the last sweep of the same
cells (the record says how each side was run).

    python scripts/bench/sizes.py [--quick] [--smoke] [--only compile|dp] [--launches K] [--rounds N]
                                  [--warmup N] [--results PATH] [--png PATH]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compiled  # noqa: E402
import data_parallel  # noqa: E402
from common import ROOT  # noqa: E402
from harness import bench_parser, median_and_spread, update_results  # noqa: E402
from size_grid import QUICK, Cell, sweep_cells  # noqa: E402

PNG = ROOT / "bench" / "sizes.png"
COMPARISONS = {  # column -> what the ratio divides (Sluice's side / its peer)
    "compile": "compiled (auto) / eager, one process",
    "compile_pp2": "compiled (auto) / eager, pp2",
    "dp": "dp2 / DDP",
    "zero1": "zero1 / DDP + ZeroRedundancyOptimizer",
}
SIDES = {"compile": ("compile", "compile_pp2"), "dp": ("dp", "zero1")}  # `--only` -> the columns it measures
SMOKE = Cell(64, 2, 16, 1, 2)  # one tiny cell, one round: checks the script works


LAYOUTS = {"one-process": "compile", "pp2": "compile_pp2"}  # compiled.py's layout -> this sweep's column


def compile_cells(cells: list[Cell], warmup: int, rounds: int, cache: str | None = None) -> dict[str, dict]:
    """Compiled (`train.compile=auto`) against eager at each cell, one process and pp2 (`compiled.measure_cells`):
    by cell name, by column, the ratio compiled / eager, its spread, both medians and auto's choice."""
    out: dict[str, dict] = {}
    for row in compiled.measure_cells(cells, layouts=tuple(LAYOUTS), warmup=warmup, rounds=rounds, mode="auto",
                                      cache=cache):
        out.setdefault(row["cell"], {})[LAYOUTS[row["layout"]]] = {
            "ratio": row["ratio"], "spread": row["spread"], "sluice_s": row["compiled_s"], "torch_s": row["eager_s"],
            "choice": row.get("choice"), "round_ratios": row.get("round_ratios")}
    return out


def pooled(launches: list[dict[str, dict]]) -> dict[str, dict]:
    """One side's cells measured in several launches, as one: by cell and column, the per-round ratios of every
    launch pooled into one median and spread, each launch's own ratio beside them ("launch_ratios"), the step times'
    medians over the launches' medians, every round's times, and auto's choice as most launches made it (all of them
    in "choices" where they differ)."""
    out: dict[str, dict] = {}
    for cell, columns in launches[0].items():
        out[cell] = {}
        for column in columns:
            rows = [launch[cell][column] for launch in launches]
            row = {**rows[0], **median_and_spread([x for r in rows for x in r["round_ratios"]]),
                   "launch_ratios": [r["ratio"] for r in rows]}
            for key, value in rows[0].items():
                if key.endswith("_runs_s"):
                    row[key] = [x for r in rows for x in r[key]]
                elif key.endswith("_min_s"):
                    row[key] = min(r[key] for r in rows)
                elif key.endswith("_s") and isinstance(value, float):
                    row[key] = statistics.median(r[key] for r in rows)
            choices = [r.get("choice") for r in rows]
            row["choice"] = Counter(choices).most_common(1)[0][0]
            if len(set(choices)) > 1:
                row["choices"] = choices
            out[cell][column] = row
    return out


def measured(measure, launches: int) -> dict[str, dict]:
    """`measure()` (one side's cells, by cell and column) over `launches` launches, pooled."""
    return pooled([measure() for _ in range(launches)]) if launches > 1 else measure()


def worst(ratios: dict[str, dict]) -> dict | None:
    """The cell and comparison where Sluice stands worst against its peer (the highest ratio)."""
    found = [(row["ratio"], cell, column, row["spread"]) for cell, columns in ratios.items()
             for column, row in columns.items()]
    if not found:
        return None
    ratio, cell, column, spread = max(found)
    return {"cell": cell, "comparison": column, "ratio": ratio, "spread": spread}


def draw_heat_map(section: dict, path: Path) -> Path:
    """Rows = cells, columns = comparisons, colour = ratio (green below 1, red above), each square `ratio ± spread`
    (and what `train.compile=auto` chose)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    cells, columns = section["cells"], list(COMPARISONS)
    values = np.full((len(cells), len(columns)), np.nan)
    for i, cell in enumerate(cells):
        for j, column in enumerate(columns):
            row = section["ratios"].get(cell, {}).get(column)
            if row is not None:
                values[i, j] = row["ratio"]
    finite = values[np.isfinite(values)]
    reach = max(0.1, float(np.abs(finite - 1).max())) if finite.size else 0.1
    fig, ax = plt.subplots(figsize=(2.0 * len(columns) + 2.5, 0.6 * len(cells) + 1.6))
    cmap = plt.get_cmap("RdYlGn_r").with_extremes(bad="#dddddd")  # grey: a comparison not measured
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, aspect="auto",
                      norm=TwoSlopeNorm(vcenter=1.0, vmin=1 - reach, vmax=1 + reach))
    for i, cell in enumerate(cells):
        for j, column in enumerate(columns):
            row = section["ratios"].get(cell, {}).get(column)
            text = "—" if row is None else f"{row['ratio']:.2f} ± {row['spread']:.2f}" + (
                f"\n(auto: {row['choice']})" if row.get("choice") else "")
            dark = row is not None and abs(row["ratio"] - 1) > 0.6 * reach  # deep red or green under the text
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(columns)), [COMPARISONS[c] for c in columns], fontsize=7, rotation=12)
    ax.set_yticks(range(len(cells)), cells, fontsize=8)
    ax.set_title("Sluice / peer step time by model size (below 1: Sluice faster); hidden-layers-seq-micro-batch",
                 fontsize=9)
    fig.colorbar(image, ax=ax, label="step time ratio")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def kept_from_last(results: Path, cells: list[str], only: str, ratios: dict, runs: dict) -> tuple[dict, dict]:
    """`ratios` and `runs` of the side just measured, with the other side's columns and run record taken from the
    last sweep in `results` where it measured the same cells (else that side is left out)."""
    last = json.loads(results.read_text()).get("sizes") if results.exists() else None
    if not last or last.get("cells") != cells:
        return ratios, runs
    for side, columns in SIDES.items():
        if side == only or side not in last.get("runs", {}):
            continue
        runs[side] = last["runs"][side]
        for cell in cells:
            ratios[cell].update({c: row for c, row in last["ratios"].get(cell, {}).items() if c in columns})
    return ratios, runs


def command_of(argv: list[str]) -> str:
    """How the sweep was run, as the page shows it: the script and its options, not where it wrote."""
    shown, skip = [], False
    for arg in argv:
        if arg in ("--results", "--png"):
            skip = True
        elif not skip:
            shown.append(arg)
        else:
            skip = False
    return " ".join(["python scripts/bench/sizes.py", *shown])


def main(argv: list[str]) -> dict:
    parser = bench_parser(__doc__, "one tiny cell, 1 round: checks the script works", rounds=6, warmup=1)
    parser.add_argument("--quick", action="store_true", help="the QUICK subset of cells (the default make bench)")
    parser.add_argument("--only", choices=("compile", "dp"), help="one side of the sweep only")
    parser.add_argument("--png", type=Path, default=PNG)
    parser.add_argument("--launches", type=int, default=1,
                        help="measure each side this many times in fresh processes and pool the rounds")
    args = parser.parse_args(argv)
    cells = [SMOKE] if args.smoke else QUICK if args.quick else sweep_cells()
    rounds = 1 if args.smoke else args.rounds
    warmup = 0 if args.smoke else args.warmup
    start = time.perf_counter()
    ratios: dict[str, dict] = {cell.name: {} for cell in cells}
    with tempfile.TemporaryDirectory() as cache:  # the launches' tokenized data, made once
        if args.only != "dp":
            for name, columns in measured(lambda: compile_cells(cells, warmup, rounds, cache), args.launches).items():
                ratios[name].update(columns)
    if args.only != "compile":
        for name, columns in measured(lambda: data_parallel.measure_cells(cells, warmup, rounds),
                                      args.launches).items():
            ratios[name].update(columns)
    run = {"command": command_of(argv), "launches": args.launches, "fresh_per_cell": True, "rounds": rounds,
           "warmup": warmup, "wall_s": time.perf_counter() - start}
    runs = {side: run for side in SIDES if args.only in (None, side)}
    if args.only:  # the other side's columns stay as last measured, with how they were
        ratios, runs = kept_from_last(args.results, [c.name for c in cells], args.only, ratios, runs)
    png = draw_heat_map({"cells": [c.name for c in cells], "ratios": ratios}, args.png)
    section = {"cells": [c.name for c in cells], "comparisons": COMPARISONS, "ratios": ratios,
               "worst": worst(ratios), "within_spread": all(row["ratio"] <= 1.0 + row["spread"]
                                                            for columns in ratios.values() for row in columns.values()),
               "runs": runs,
               "png": str(png.resolve().relative_to(ROOT)) if png.resolve().is_relative_to(ROOT) else str(png)}
    update_results("sizes", section, args.results)
    for name, columns in ratios.items():
        print(f"{name}: " + ", ".join(f"{c} {r['ratio']:.3f} ± {r['spread']:.3f}" for c, r in columns.items()))
    if section["worst"]:
        w = section["worst"]
        print(f"worst: {w['comparison']} at {w['cell']}, {w['ratio']:.3f} ± {w['spread']:.3f}; heat map {png}")
    return section


if __name__ == "__main__":
    main(sys.argv[1:])
