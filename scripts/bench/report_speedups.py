"""The benchmark page's sections on speed across sizes: compiled layers against eager, and the size sweep (every
comparison with a peer at each cell of `size_grid`). Apart from report.py to keep each file short."""

from __future__ import annotations

import json
import os
from pathlib import Path


def compiled_section(r: dict) -> list[str]:
    """`train.compile` against eager at the compile benchmark's sizes, and what `auto` does."""
    c = r.get("compiled")
    if not c:
        return []
    out = ["## Compiled layers: `train.compile=true` against eager", "",
           "The same Trainer, model, data and AdamW; each decoder layer compiled by `torch.compile` (inductor) after "
           "the TP, EP and recompute passes. Both variants in the same processes, one step each per round after a "
           "warm-up that includes the compiling step (`scripts/bench/compiled.py`); one process on both cores, the "
           "1F1B pipeline (pp2) on one core each. fp32.", "",
           "| setup | tokens per step | eager step (s) | compiled step (s) | tokens/s compiled / eager | compile (s) "
           "| matmul + attention share of eager |", "|---|---|---|---|---|---|---|"]
    for row in c["rows"]:
        s = row["setup"]
        out.append(f"| {row['name']} | {s['seq'] * s['micro_batch_size'] * s['microbatches']} | {row['eager_s']:.3f} "
                   f"| {row['compiled_s']:.3f} | {row['speedup']:.3f} | {row['compile_s']:.1f} "
                   f"| {row['matmul_share']:.1%} |")
    out += ["", "Compiling fuses the elementwise work around the matrix multiplies; the multiplies and the attention "
            "kernel (BLAS and torch's own, profiled in the same run) stay as they are, and AdamW is not compiled. "
            "Where they take most of an fp32 CPU step, as at the default size, the gain is bounded by the rest of "
            "the step: at most 1 / (their share) even if the rest took no time.", "",
            "`train.compile=auto` (the default on CUDA, `false` on a CPU) compiles, runs step 2 eager (the eager "
            "layers' cold first call, not timed), times steps 3-10 compiled and eager in turns (C E E C C E E C), "
            "keeps the faster median on every rank (one all-reduce) and logs it; the size sweep "
            "measures it. At issue 39's losing cell dynamo neither recompiled nor broke a graph and inductor shares "
            "torch's OpenMP threads; on one thread compiled took 0.90x eager's CPU time, on two a loaded 2-core "
            "machine swung it 0.5-1.9x a round."]
    return out + ["", "First losses equal to 1e-5 relative in every setup." if all(row["losses_close"] for row in
                                                                                   c["rows"]) else
                  "**First losses differ** beyond 1e-5 relative.", ""]


def _sweep_runs(runs: dict) -> str:
    """How each side of the sweep was run: one clause if both sides came from one run, else one per side."""
    said = lambda r: (f"with `{r['command']}` ({_launches(r)}{r['rounds']} rounds after {r['warmup']} warm-up, "
                      f"{r['wall_s'] / 60:.1f} min)")
    if len({json.dumps(r, sort_keys=True) for r in runs.values()}) == 1:
        return said(next(iter(runs.values())))
    return " and ".join(f"{said(r)} for the {side} columns" for side, r in runs.items())


def _launches(run: dict) -> str:
    """"K launches of " where a side was measured in several launches, pooled."""
    return f"{run['launches']} launches of " if run.get("launches", 1) > 1 else ""


def _fresh(runs: dict) -> str:
    """Which sides started fresh processes for each cell (older sweeps ran every cell in one spawn per layout)."""
    fresh = [side for side, run in runs.items() if run.get("fresh_per_cell")]
    if len(fresh) == len(runs):
        return " (fresh ones for each cell)"
    return (f" (fresh ones for each cell in the {' and '.join(fresh)} columns, one spawn for every cell in the "
            "others')" if fresh else "")


def _pooling(runs: dict) -> str:
    """Why the rounds of several launches were pooled, where they were."""
    if all(run.get("launches", 1) == 1 for run in runs.values()):
        return ""
    return ("; where a side ran several launches (fresh processes, freshly built models) their rounds are pooled: a "
            "variant built in a process keeps a speed of its own for the process's life, so one launch's median moves "
            "from launch to launch more than its rounds' spread says, and more rounds in one launch cannot average "
            "that out")


def sizes_section(r: dict, doc_path: Path, root: Path, machine: str) -> list[str]:
    """The size sweep: the heat map, the machine and command it was measured with, the table and the worst cell."""
    z = r.get("sizes")
    if not z:
        return []
    columns = z["comparisons"]
    out = ["## Model sizes: Sluice / peer across a grid of sizes", "",
           f"Measured {_sweep_runs(z['runs'])} on {machine} (`scripts/bench/sizes.py`, cells in "
           "`scripts/bench/size_grid.py`: MiniMind-3's shape, vocab 6400, one axis at a time around hidden 256, 4 "
           "layers, seq 128, micro-batch 2, 4 micro-batches, plus the 8-layer cell issue 39 found losing). Each "
           "cell's two variants alternate in the same processes" + _fresh(z["runs"]) + ", one step each per round, "
           "the order reversed every other round; the ratio is the median of the per-round ratios Sluice / peer "
           "(below 1: Sluice faster), ± half their interquartile range" + _pooling(z["runs"]) + ". Compile: the "
           "Trainer with "
           "`train.compile=auto` against eager, one process (both cores) and pp2 (one core each); DP: as in the "
           "data-parallel section, at each size.", ""]
    if z.get("png"):
        out += [f"![size sweep]({os.path.relpath(root / z['png'], doc_path.parent)})", ""]
    out += ["| cell (hidden-layers-seq-micro-batch) | " + " | ".join(columns.values()) + " |",
            "|---" * (len(columns) + 1) + "|"]
    for cell in z["cells"]:
        row = z["ratios"].get(cell, {})
        out.append(f"| {cell} | " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    cpu = {c: [row[c]["sluice_cpu_s"] / row[c]["torch_cpu_s"] for row in z["ratios"].values()
               if "sluice_cpu_s" in row.get(c, {})] for c in columns}
    rounds = [x for row in z["ratios"].values() for v in row.values() for x in v.get("round_ratios") or ()]
    if any(cpu.values()) and rounds:
        out += ["", f"Per-round ratios ranged {min(rounds):.2f} to {max(rounds):.2f}. CPU time (both ranks' "
                "process time, medians; what a step costs whatever else the machine runs) Sluice / peer: "
                + "; ".join(f"{columns[c]} {min(v):.3f} to {max(v):.3f}" for c, v in cpu.items() if v) + "."]
    if z.get("worst"):
        w = z["worst"]
        out += ["", f"Worst cell: {columns[w['comparison']]} at {w['cell']}, {w['ratio']:.3f} ± {w['spread']:.3f}"
                + ("; every cell within 1.00 + its spread." if z["within_spread"]
                   else "; **not every cell within 1.00 + its spread**.")]
    return out + _beyond(z) + [""]


def _beyond(z: dict) -> list[str]:
    """The cells above 1 + their spread, and where the median's distribution-free ~95% interval lies above 1 (a
    Sluice side slower than its peer beyond the rounds' noise, not only beyond half their IQR)."""
    from harness import median_interval

    rows = [(cell, column, row) for cell in z["cells"] for column, row in z["ratios"].get(cell, {}).items()]
    above = [f"{column} at {cell} ({row['ratio']:.3f} ± {row['spread']:.3f})" for cell, column, row in rows
             if row["ratio"] > 1 + row["spread"]]
    intervals = {(cell, column): median_interval(row["round_ratios"]) for cell, column, row in rows
                 if len(row.get("round_ratios") or ()) > 1}
    slower = [f"{column} at {cell} [{lo:.3f}, {hi:.3f}]" for (cell, column), (lo, hi, _) in intervals.items() if lo > 1]
    coverage = sorted({f"{c:.0%}" for _, _, c in intervals.values()})
    return ["", "Above 1 + spread: " + ("; ".join(above) or "none") + f". The median's distribution-free interval "
            f"(order statistics of the per-round ratios, coverage {' / '.join(coverage)}) lies wholly above 1 in "
            f"{len(slower)} of {len(intervals)} cells" + (": " + "; ".join(slower) if slower else "") + "."]


def _cell(row: dict | None) -> str:
    """One square of the size sweep: ratio ± spread, and what `train.compile=auto` chose where it chose."""
    if row is None:
        return "—"
    chose = row.get("choice")
    if chose and row.get("choices"):
        chose += f" {row['choices'].count(chose)}/{len(row['choices'])}"
    return f"{row['ratio']:.3f} ± {row['spread']:.3f}" + (f" ({chose})" if chose else "")
