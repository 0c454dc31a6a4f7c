"""Sleep benchmark: every schedule's measured step against the simulator's ideal makespan for the same costs.

Each stage is one `SleepLayer` (F, I and W sleep a fixed time, no CPU). The ideal is the simulator's makespan
for the stage costs as measured alone, one stage at a time in one process with plain autograd: the sleep plus
the model code around it (embedding, head, loss; on this machine a 40 ms F costs about 41.5 ms). So the
distance to the ideal is what scheduling and transport cost, not the stages themselves. The nominal ideal
(every action exactly its sleep) is reported beside it. pp=4 gloo processes; Sluice (its default transport,
shared memory between the ranks of this host) and torch.distributed.pipelining's counterpart of each schedule
(gloo) run alternately, one step each per round; at the smallest m, Sluice over gloo too ("sluice_gloo"), to
tell the runtime's share from the transport's. Writes the "sleep" section of results.json and, for m=8, a
measured-vs-simulated PNG per Sluice schedule. `make bench` measures m=8 (`--microbatches 8 16` adds m=16: ratios to
the ideal within 0.01 of m=8's when last measured, for twice the time).

    python scripts/bench/schedules.py [--smoke] [--rounds N] [--f-ms MS] [--microbatches M ...] [--results PATH]
                                      [--png-dir DIR]
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, run_workers, stamped  # noqa: E402
from harness import alternate, bench_parser, paired, timed, update_results  # noqa: E402
from sleep_model import sleep_model, stage_costs_alone  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from models import decoder_of  # noqa: E402
from parallel.engine import build_engine  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from parallel.pipeline.actions import Costs  # noqa: E402
from parallel.pipeline.lowered import lower_pipeline  # noqa: E402
from parallel.pipeline.schedules import SCHEDULES  # noqa: E402
from torch_pipe import COUNTERPARTS  # noqa: E402
from parallel.spec import PipelineSpec  # noqa: E402
from training.specs import default_engine_spec  # noqa: E402
from parallel.step import MicroBatch  # noqa: E402

PP = 4
HIDDEN, VOCAB, SEQ = 64, 128, 128  # boundary tensor 1 x 128 x 64 fp32 = 32 KiB


@dataclass(frozen=True)
class Setup:
    """One benchmark run's sizes; the same on every worker."""

    microbatches: tuple[int, ...]
    f_s: float  # forward sleep of one rank's whole share of the model (split over its chunks)
    warmup: int
    rounds: int
    png_dir: str | None
    schedules: tuple[str, ...] = tuple(n for n in SCHEDULES if n in COUNTERPARTS)  # the registry's, where torch has one


def costs(setup: Setup, vpp: int) -> Costs:
    """Per-chunk costs: the model is the same whatever vpp, so each of a rank's vpp chunks does 1/vpp of it."""
    f = setup.f_s / vpp
    return Costs(f=f, b=2 * f, i=f, w=f, comm=0.0)


def batches(m: int) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(m)
    return stamped([MicroBatch(torch.randint(0, VOCAB, (1, SEQ), generator=gen),
                               torch.randint(0, VOCAB, (1, SEQ), generator=gen)) for _ in range(m)])


def worker(rank: int, world: int, setup: Setup) -> dict | None:
    """Every schedule at every m, Sluice and torch alternated; rank 0 returns the figures."""
    from torch_pipe import build

    grid = ParallelGrid.build(dp=1, tp=1, pp=PP, backend="gloo", timeout_s=300)
    out: dict = {}
    stage_costs: dict[int, Costs] = {}  # by chunks per rank: the model differs only in that
    for m in setup.microbatches:
        micro = batches(m)
        tokens = sum(mb.num_label_tokens() for mb in micro)
        variants, ideal, nominal, engines = {}, {}, {}, {}
        for name in setup.schedules:
            vpp = SCHEDULES[name].default_vpp
            c = costs(setup, vpp)
            model = sleep_model(PP * vpp, HIDDEN, VOCAB, c.f, c.i, c.w)
            if vpp not in stage_costs:
                stage_costs[vpp] = measured_alone(model, PP * vpp, micro[0], rank)
            pipeline = PipelineSpec(pp=PP, vpp=vpp, schedule=name, n_microbatches=m)
            spec = default_engine_spec(pipeline, 1, SEQ, timeout_s=120.0)
            engines[name] = build_engine(spec, decoder_of(model), grid)  # the default transport: shared memory here
            lowered = lower_pipeline(pipeline, PP * vpp)
            ideal[name] = lowered.simulate(stage_costs[vpp]).makespan
            nominal[name] = lowered.simulate(c).makespan
            variants[f"sluice {name}"] = lambda e=engines[name]: e.step(micro)
            torch_pipe = build(name, model, PP, m, grid.pp_rank, tokens, None)
            variants[f"torch {name}"] = lambda t=torch_pipe: t.step(micro, tokens)
            if m == min(setup.microbatches):  # Sluice over gloo too, as torch runs: what the runtime alone gives
                on_gloo = build_engine(replace(spec, transport="p2p"), decoder_of(model), grid)
                variants[f"sluice_gloo {name}"] = lambda e=on_gloo: e.step(micro)
        times = alternate(variants, setup.warmup, setup.rounds)
        traced = {name: traced_step(engine, name, setup, m, rank, stage_costs[SCHEDULES[name].default_vpp])
                  for name, engine in engines.items()}
        out[m] = {name: {"ideal_s": ideal[name], "nominal_ideal_s": nominal[name],
                         "sluice_transport": type(engines[name].transport).__name__,
                         **(times[f"sluice_gloo {name}"].summary("sluice_gloo") if f"sluice_gloo {name}" in times
                            else {}),
                         "stage_f_s": stage_costs[SCHEDULES[name].default_vpp].stage_f,
                         "stage_b_s": stage_costs[SCHEDULES[name].default_vpp].stage_b,
                         **times[f"sluice {name}"].summary("sluice"), **times[f"torch {name}"].summary("torch"),
                         **traced[name]} for name in setup.schedules}
    return out if rank == 0 else None


def measured_alone(model, n_stages: int, batch: MicroBatch, rank: int) -> Costs:
    """Every stage's costs timed by rank 0 while the other ranks wait (so nothing else runs), sent to all."""
    box = [stage_costs_alone(model, n_stages, batch) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def traced_step(engine, name: str, setup: Setup, m: int, rank: int, ideal: Costs) -> dict:
    """One traced Sluice step: its mean action durations inside the pipeline (beside the ones measured alone,
    they show what sharing the machine with the other ranks adds) and, at the smallest m, the measured step
    drawn under the ideal one (PNG)."""
    from parallel.pipeline.timeline import draw_measured_vs_simulated

    _, _, result = timed(lambda: engine.step(batches(m), trace=True))
    if rank != 0:
        return {}
    vpp = SCHEDULES[name].default_vpp
    spans: dict[str, list[float]] = {}
    records = [r for rank_records in result.trace.values() for r in rank_records]
    for action, start, end in records:
        kind = str(action)[0]  # "F3@s1" -> F; SEND_*/RECV_* (S, R) are transfers, not compute
        if kind in "FBIW":
            spans.setdefault(kind, []).append(end - start)
    span = max(end for _, _, end in records) - min(start for _, start, _ in records)
    mean = {k: statistics.fmean(v) for k, v in spans.items()}
    if setup.png_dir and m == min(setup.microbatches):
        lowered = lower_pipeline(PipelineSpec(pp=PP, vpp=vpp, schedule=name, n_microbatches=m), PP * vpp)
        path = Path(setup.png_dir) / f"sleep_{name}_pp{PP}_m{m}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        draw_measured_vs_simulated(lowered.simulate(ideal), result.trace, path,
                                 title=f"{name}, pp={PP}, m={m} (seconds)")
    return {"traced_span_s": span, "traced_action_s": mean}


def summarise(by_m: dict) -> dict:
    """results.json's "sleep" section: the m=8 (or smallest m) ratios on top, every m below."""
    first = min(by_m)
    section = {}
    for name in next(iter(by_m.values())):
        rows = {str(m): {**r[name], "sluice_over_ideal": r[name]["sluice_s"] / r[name]["ideal_s"],
                         **({"sluice_gloo_over_ideal": r[name]["sluice_gloo_s"] / r[name]["ideal_s"]}
                            if "sluice_gloo_s" in r[name] else {}),
                         "torch_over_ideal": r[name]["torch_s"] / r[name]["ideal_s"],
                         "sluice_over_nominal": r[name]["sluice_s"] / r[name]["nominal_ideal_s"],
                         "torch_over_nominal": r[name]["torch_s"] / r[name]["nominal_ideal_s"], **paired(r[name])}
                for m, r in by_m.items()}
        top = rows[str(first)]
        section[name] = {key: top[key] for key in ("sluice_over_ideal", "torch_over_ideal", "sluice_over_nominal",
                                                   "torch_over_nominal", "sluice_gloo_over_ideal")}
        section[name] |= {"m": first, "by_m": rows}
    return section


def main(argv: list[str]) -> dict:
    parser = bench_parser(__doc__, "tiny run to check the script works (m=4, 1 round, 1f1b and zbv unless "
                          "--schedules)", rounds=7, warmup=1)  # sleeps: 11 rounds spread under 1%, 7 do as well
    parser.add_argument("--f-ms", type=float, default=40.0, help="forward sleep of one rank's share of the model")
    parser.add_argument("--schedules", nargs="+", choices=list(Setup.schedules))
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--png-dir", type=Path, default=ROOT / "bench" / "timelines")
    args = parser.parse_args(argv)
    if args.smoke:  # a loop schedule and a V one: every code path of the script, in a fraction of the time
        setup = Setup((4,), 0.004, 1, 1, str(args.png_dir), tuple(args.schedules or ("1f1b", "zbv")))
    else:
        setup = Setup(tuple(args.microbatches), args.f_ms / 1000, args.warmup, args.rounds, str(args.png_dir),
                      tuple(args.schedules or Setup.schedules))
    section = summarise(run_workers(worker, PP, setup, timeout=1200)[0])
    pngs = sorted(args.png_dir.glob(f"sleep_*_m{min(setup.microbatches)}.png"))
    timelines = [str(p.resolve().relative_to(ROOT)) if p.resolve().is_relative_to(ROOT) else str(p) for p in pngs]
    setup = replace(setup, png_dir=None)  # where they went is in "timelines", relative to the repository
    update_results("sleep", {**section, "setup": asdict(setup), "timelines": timelines}, args.results)
    print(f"{'schedule':18s} {'m':>3s} {'ideal s':>8s} {'sluice s':>9s} {'torch s':>8s} {'sluice/ideal':>13s} "
          f"{'torch/ideal':>12s} {'sluice/nominal':>15s} {'torch/nominal':>14s} {'paired ms':>10s} {'wins':>6s}")
    for name in setup.schedules:
        for m, r in section[name]["by_m"].items():
            print(f"{name:18s} {m:>3s} {r['ideal_s']:8.3f} {r['sluice_s']:9.3f} {r['torch_s']:8.3f} "
                  f"{r['sluice_over_ideal']:13.3f} {r['torch_over_ideal']:12.3f} {r['sluice_over_nominal']:15.3f} "
                  f"{r['torch_over_nominal']:14.3f} {r['paired_diff_ms']:+10.2f} "
                  f"{r['sluice_wins']:>3d}/{r['rounds']:<2d}")
    return section


if __name__ == "__main__":
    main(sys.argv[1:])
