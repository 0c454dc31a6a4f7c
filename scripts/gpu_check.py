"""The device acceptance check (issue 37): under 10 minutes on one GPU, one table, exit 1 when a figure is out of range.

  python scripts/gpu_check.py                 # on a CUDA machine; runs and metrics under gpu_check_out/
  python scripts/gpu_check.py --dry-run       # anywhere: compose and validate every run, print checks and ranges
  python scripts/gpu_check.py --only resume   # the checks whose name holds one of these words

Every check names the runs it reads (train.py runs, each in its own run directory) and the range its figure must fall
in, written beside it below. Runs that need more GPUs than the machine has are skipped, and so are their checks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# fp32 equivalence runs: tiny, 4 steps, 16 sequences a step whatever the layout (n_microbatches follows from it).
TINY = ("model=tiny", "train.dtype=fp32", "train.steps=4", "train.seq_len=64", "train.micro_batch_size=4",
        "train.global_batch_size=16", "optim.warmup_steps=0", "optim.lr=1e-3", "logger=none", "train.log_every=1",
        "data.num_docs=400")
EMULATED = ("parallel.pp=2", "parallel.emulate=true")
MOE_BF16 = ("model=tiny-moe", "train.dtype=bf16", "train.steps=6", *EMULATED)
MINIMIND3 = ("model=minimind3", "train.dtype=bf16", "train.steps=30", "train.micro_batch_size=16", "train.seq_len=512",
             "schedule.n_microbatches=2", "logger=none", "train.log_every=10")
LLAMA_1B = ("model=minimind3", "model.hidden_size=2048", "model.num_hidden_layers=16", "model.num_attention_heads=32",
            "model.num_key_value_heads=8", "model.intermediate_size=8192", "train.dtype=bf16", "train.steps=10",
            "train.micro_batch_size=4", "train.seq_len=2048", "schedule.n_microbatches=1", "logger=none",
            "train.log_every=5")
SYNCS = ("train.steps=8", "train.log_every=1000")  # steps 1 and 8 log; 3..7 are the counted non-logging steps
SYNC_FILE = "syncs.jsonl"


@dataclass(frozen=True)
class Run:
    """One train.py run: its overrides and the GPUs it takes (0: on the CPU, CUDA hidden; 2: two local workers)."""

    name: str
    overrides: tuple[str, ...]
    gpus: int = 1
    count_syncs: bool = False  # in-process, counting the synchronising CUDA calls of each step
    after: str | None = None  # the run whose outputs its `{out}` overrides name (a dry run validates without them)


RUNS = [
    Run("cpu", TINY, gpus=0),
    Run("gpu", TINY),
    Run("pp2_1f1b", (*TINY, *EMULATED, "schedule=1f1b")),
    Run("pp2_interleaved", (*TINY, *EMULATED, "schedule=interleaved-1f1b", "parallel.vpp=2")),
    Run("pp2_zbh1_selective", (*TINY, *EMULATED, "schedule=zb-h1", "train.recompute=selective")),
    Run("pp2_zbv_full", (*TINY, *EMULATED, "schedule=zbv", "parallel.vpp=2", "train.recompute=full")),
    Run("moe_pp2_bf16", MOE_BF16),
    Run("moe_pp2_bf16_compiled", (*MOE_BF16, "train.compile=true")),
    Run("saved", (*TINY, "train.steps=5", "checkpoint.every=3", "checkpoint.save_final=false")),
    Run("resumed", (*TINY, "train.steps=5", "checkpoint.resume={out}/saved/checkpoints/step_00000003"),
        after="saved"),
    Run("syncs_dense", (*TINY, *SYNCS), count_syncs=True),
    Run("syncs_pp2_1f1b", (*TINY, *SYNCS, *EMULATED, "schedule=1f1b"), count_syncs=True),
    Run("syncs_moe", (*TINY, *SYNCS, "model=tiny-moe"), count_syncs=True),
    Run("minimind3_eager", MINIMIND3),
    Run("minimind3_compiled", (*MINIMIND3, "train.compile=true")),
    Run("llama_1b", LLAMA_1B),
    Run("gpu2_dp2_zero1", (*TINY, "parallel.dp=2", "parallel.zero=1"), gpus=2),
    Run("gpu2_tp2", (*TINY, "parallel.tp=2"), gpus=2),
    Run("gpu2_pp2_zbv", (*TINY, "parallel.pp=2", "schedule=zbv", "parallel.vpp=2"), gpus=2),
    Run("moe", (*TINY, "model=tiny-moe")),
    Run("gpu2_ep2", (*TINY, "model=tiny-moe", "parallel.dp=2", "parallel.ep=2"), gpus=2),
]

Rows = dict[str, list[dict]]  # run name -> its metrics.jsonl rows


def worst(field: str, run: str, baseline: str) -> Callable[[Rows], float]:
    """The largest relative difference of `field` between two runs, step by step."""
    def measure(rows: Rows) -> float:
        pairs = list(zip(rows[run], rows[baseline], strict=True))
        return max(abs(a[field] - b[field]) / max(abs(b[field]), 1e-12) for a, b in pairs)
    return measure


def resumed_vs_saved(rows: Rows) -> float:
    """Steps 4 and 5 of the resumed run against the same steps of the run that saved at step 3."""
    saved = {r["step"]: r["loss"] for r in rows["saved"]}
    return max(abs(r["loss"] - saved[r["step"]]) / abs(saved[r["step"]]) for r in rows["resumed"])


def last(run: str, field: str, scale: float = 1.0) -> Callable[[Rows], float]:
    """`field` of the run's last logged step (missing: NaN, out of every range)."""
    return lambda rows: rows[run][-1].get(field, math.nan) * scale


def most_syncs(run: str) -> Callable[[Rows], float]:
    """The most synchronising CUDA calls in one non-logging step of a counted run."""
    return lambda rows: max(rows[run][0]["per_step"].values())


@dataclass(frozen=True)
class Check:
    """A figure measured from some runs, and the range it must fall in."""

    name: str
    runs: tuple[str, ...]
    measure: Callable[[Rows], float]
    low: float
    high: float
    unit: str = ""


def equal(name: str, run: str, baseline: str, loss: float, grad_norm: float) -> list[Check]:
    return [Check(f"{name}: loss", (run, baseline), worst("loss", run, baseline), 0.0, loss, "rel"),
            Check(f"{name}: grad norm", (run, baseline), worst("grad_norm", run, baseline), 0.0, grad_norm, "rel")]


GIB = 2.0 ** -30
CHECKS = [
    *equal("fp32 GPU vs CPU", "gpu", "cpu", 1e-4, 1e-3),
    *equal("pp2 1F1B (emulated) vs GPU", "pp2_1f1b", "gpu", 1e-5, 1e-4),
    *equal("pp2 interleaved vpp2 vs GPU", "pp2_interleaved", "gpu", 1e-5, 1e-4),
    *equal("pp2 ZB-H1 selective recompute vs GPU", "pp2_zbh1_selective", "gpu", 1e-5, 1e-4),
    *equal("pp2 ZB-V full recompute vs GPU", "pp2_zbv_full", "gpu", 1e-5, 1e-4),
    # bf16 and inductor's fused kernels round differently from eager: the order of bf16 against fp32, not a factor.
    Check("compiled bf16 MoE pp2 vs eager: loss", ("moe_pp2_bf16_compiled", "moe_pp2_bf16"),
          worst("loss", "moe_pp2_bf16_compiled", "moe_pp2_bf16"), 0.0, 2e-2, "rel"),
    Check("save at step 3, resume: steps 4-5 loss", ("saved", "resumed"), resumed_vs_saved, 0.0, 1e-6, "rel"),
    Check("host syncs per step: dense", ("syncs_dense",), most_syncs("syncs_dense"), 0, 2),
    Check("host syncs per step: pp2 1F1B", ("syncs_pp2_1f1b",), most_syncs("syncs_pp2_1f1b"), 0, 2),
    Check("host syncs per step: MoE", ("syncs_moe",), most_syncs("syncs_moe"), 0, 2),
    Check("MiniMind-3 64M bf16 eager: tokens/s", ("minimind3_eager",), last("minimind3_eager", "tokens_per_s"),
          1e5, 1e7),
    Check("MiniMind-3 64M bf16 eager: MFU", ("minimind3_eager",), last("minimind3_eager", "mfu"), 0.10, 0.80),
    Check("MiniMind-3 64M bf16 compiled: tokens/s", ("minimind3_compiled",),
          last("minimind3_compiled", "tokens_per_s"), 1e5, 1e7),
    Check("MiniMind-3 64M bf16 compiled: MFU", ("minimind3_compiled",), last("minimind3_compiled", "mfu"), 0.15, 0.80),
    Check("1B Llama shape bf16: tokens/s", ("llama_1b",), last("llama_1b", "tokens_per_s"), 1e4, 1e6),
    Check("1B Llama shape bf16: MFU", ("llama_1b",), last("llama_1b", "mfu"), 0.25, 0.80),
    Check("1B Llama shape bf16: peak memory", ("llama_1b",), last("llama_1b", "peak_mem_bytes", GIB), 8, 100, "GiB"),
    *equal("2 GPUs dp2 + ZeRO-1 vs GPU", "gpu2_dp2_zero1", "gpu", 1e-4, 1e-3),
    *equal("2 GPUs tp2 vs GPU", "gpu2_tp2", "gpu", 1e-4, 1e-3),
    *equal("2 GPUs pp2 ZB-V vs GPU", "gpu2_pp2_zbv", "gpu", 1e-4, 1e-3),
    *equal("2 GPUs MoE ep2 vs GPU", "gpu2_ep2", "moe", 1e-4, 1e-3),
]


@dataclass(frozen=True)
class Verdict:
    check: Check
    value: float | None  # None: skipped or a run failed
    note: str = ""

    @property
    def ok(self) -> bool | None:
        if self.value is None:
            return None
        return self.check.low <= self.value <= self.check.high


def figure(value: float) -> str:
    return f"{value:.3g}" if value == value else "n/a"


def table(verdicts: list[Verdict]) -> list[str]:
    """One line per check: name, measured, expected range, verdict."""
    width = max(len(v.check.name) for v in verdicts)
    lines = [f"{'check':<{width}}  {'measured':>10}  {'expected':<22}  verdict"]
    for v in verdicts:
        c = v.check
        expected = f"{figure(c.low)} .. {figure(c.high)} {c.unit}".rstrip()
        measured = "-" if v.value is None else figure(v.value)
        verdict = "ok" if v.ok else (v.note or ("skipped" if v.ok is None else "OUT OF RANGE"))
        lines.append(f"{c.name:<{width}}  {measured:>10}  {expected:<22}  {verdict}")
    return lines


def judge(checks: list[Check], rows: Rows, notes: dict[str, str]) -> list[Verdict]:
    """Each check's figure from the runs' rows; a check whose run is missing says why (`notes`: run -> reason)."""
    verdicts = []
    for check in checks:
        missing = [run for run in check.runs if run not in rows]
        if missing:
            verdicts.append(Verdict(check, None, notes.get(missing[0], f"no run {missing[0]}")))
            continue
        try:
            value = float(check.measure(rows))
        except (KeyError, ValueError, IndexError) as error:  # a field missing, steps that do not pair up
            verdicts.append(Verdict(check, math.nan, f"OUT OF RANGE ({type(error).__name__}: {error})"))
            continue
        verdicts.append(Verdict(check, value))
    return verdicts


def overrides(run: Run, out: Path) -> list[str]:
    """The run's train.py overrides, with its run directory and the shared data cache under `out`."""
    return [*(o.format(out=out) for o in run.overrides), f"data.cache_dir={out / 'cache'}",
            f"hydra.run.dir={out / run.name}"]


def command(run: Run, out: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one run."""
    args = overrides(run, out)
    env = dict(os.environ)
    if run.gpus == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if run.count_syncs:
        return [sys.executable, str(Path(__file__).resolve()), "--count-syncs", *args], env
    return [sys.executable, str(ROOT / "train.py"), *args], env


def selected(only: list[str] | None) -> tuple[list[Check], list[Run]]:
    """The checks named by `only` (all without it) and the runs they read, in order."""
    checks = [c for c in CHECKS if not only or any(word.lower() in c.name.lower() for word in only)]
    needed = {run for c in checks for run in c.runs}
    return checks, [r for r in RUNS if r.name in needed]


def dry_run(runs: list[Run], checks: list[Check]) -> int:
    """Compose and validate every run's config as train.py would, print the checks and their ranges."""
    from training.config.validate import validate
    from training.config.schema import compose_config
    from training.config.layout import layout_world_size

    failed = 0
    for run in runs:
        given = [o for o in run.overrides if "{out}" not in o]  # what run.after writes does not exist yet
        try:
            cfg = compose_config(given)
            validate(cfg, layout_world_size(cfg))
            print(f"gpu_check: {run.name}: {' '.join(run.overrides)}: composes and validates"
                  + (f" (its checkpoint comes from run {run.after})" if run.after else ""))
        except Exception as error:  # noqa: BLE001  a ConfigError, or Hydra's own composition errors
            print(f"gpu_check: {run.name}: {str(error).splitlines()[0]}", file=sys.stderr)
            failed += 1
    for line in table([Verdict(c, None, "dry run") for c in checks]):
        print(line)
    return 1 if failed else 0


def count_syncs(args: list[str]) -> None:
    """Run one process in-process with CUDA's sync debug mode on; write each step's synchronising calls."""
    import warnings

    import torch
    from omegaconf import OmegaConf

    from training.config.validate import validate
    from training.config.schema import compose_config
    from training.launch.workers import run_worker

    cfg = compose_config([o for o in args if not o.startswith("hydra.")])
    validate(cfg, 1)
    run_dir = Path(next(o for o in args if o.startswith("hydra.run.dir=")).partition("=")[2])
    run_dir.mkdir(parents=True, exist_ok=True)
    per_step: dict[int, int] = {}  # optimizer step -> synchronising calls seen by its end
    hook = torch.optim.optimizer.register_optimizer_step_post_hook(lambda *_: per_step.setdefault(
        len(per_step) + 1, len(seen)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        run_worker(OmegaConf.to_container(cfg, resolve=True), str(run_dir))
        torch.cuda.set_sync_debug_mode("default")
    hook.remove()
    steps = sorted(per_step)  # step k's calls: from step k-1's optimizer step to its own (the loop, the engine)
    counted = {k: per_step[k] - per_step[k - 1] for k in steps[2:-1]}  # not 1-2 (warm-up, logged) nor the last
    (run_dir / SYNC_FILE).write_text(json.dumps({"per_step": counted}) + "\n")


def execute(runs: list[Run], out: Path, gpus: int) -> tuple[Rows, dict[str, str]]:
    """Run each run the machine can (in order), read its metrics; notes say why a run is missing."""
    rows, notes = {}, {}
    for run in runs:
        if run.gpus > gpus:
            notes[run.name] = f"skipped (needs {run.gpus} GPUs, {gpus} here)"
            continue
        args, env = command(run, out)
        start = time.monotonic()
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        (out / f"{run.name}.log").write_text(done.stdout + done.stderr)
        took = time.monotonic() - start
        if done.returncode:
            lines = [line for line in done.stderr.splitlines() if line.strip()] or ["(no output)"]
            notes[run.name] = f"run {run.name} failed ({lines[-1][:60]}; {out / run.name}.log)"
            print(f"gpu_check: {run.name}: failed after {took:.0f}s (exit {done.returncode})", file=sys.stderr)
            continue
        print(f"gpu_check: {run.name}: {took:.0f}s", file=sys.stderr)
        metrics = out / run.name / (SYNC_FILE if run.count_syncs else "metrics.jsonl")
        rows[run.name] = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return rows, notes


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="compose and validate every run; run nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_check_out", help="runs and metrics go here")
    parser.add_argument("--only", nargs="+", metavar="WORD", help="the checks whose name holds one of these words")
    parser.add_argument("--count-syncs", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.count_syncs is not None:
        count_syncs(args.count_syncs)
        return 0
    checks, runs = selected(args.only)
    if not checks:
        print(f"gpu_check: no check's name holds {' or '.join(args.only)}; see --dry-run for the list",
              file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(runs, checks)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; skipped (--dry-run checks the commands anywhere)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows, notes = execute(runs, args.out, torch.cuda.device_count())
    verdicts = judge(checks, rows, notes)
    lines = table(verdicts)
    print("\n".join(lines))
    (args.out / "table.txt").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({v.check.name: v.value for v in verdicts}, indent=1))
    return 1 if any(v.ok is False or (v.ok is None and "failed" in v.note) for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
