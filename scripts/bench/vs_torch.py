"""Real model: Sluice against torch.distributed.pipelining, schedule by schedule, on the same work.

The same MiniMind (8 layers, hidden 256, seq 128), the same partition, placement, micro-batches and token-sum
loss; pp=4 gloo processes on the CPU, both frameworks passing boundary tensors over gloo (Sluice's
`parallel.transport=p2p`; its default on one CPU host, shared memory, is timed beside them as "sluice_shm");
variants alternate one step at a time (A B, then B A) after a warm-up. Each
step is forward + backward + the tied-embedding gradient sum (no optimizer: it is the same for both). Also
each stage's peak activation memory (tensors saved for backward plus boundary outputs still held).
Writes the "real" and "memory" sections of results.json.

`--size default` runs MiniMind-3 at its default size (hidden 768, 8 layers, vocab 6400) at `--pp` 2 or 4 instead,
over gloo only and with fewer, shorter steps (a step is about 30x the toy's work); it writes its schedules as
"pp<N> <schedule>" into the "full_size" section, beside the other pipeline size's.

    python scripts/bench/vs_torch.py [--smoke] [--size toy|default] [--pp N] [--rounds N] [--warmup N] [--results PATH]
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ActivationMeter, boundary, run_workers, stamped, watch_outputs  # noqa: E402
from harness import alternate, bench_parser, paired, update_results  # noqa: E402
from torch_pipe import COUNTERPARTS  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from models import decoder_of  # noqa: E402
from parallel.engine import build_engine  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from parallel.pipeline.partition import stage_to_rank  # noqa: E402
from parallel.pipeline.schedules import SCHEDULES as REGISTRY  # noqa: E402
from parallel.spec import PipelineSpec  # noqa: E402
from training.specs import default_engine_spec  # noqa: E402
from parallel.step import MicroBatch  # noqa: E402

SCHEDULES = tuple(COUNTERPARTS)  # every registered schedule torch has a counterpart of (vpp: the registry's default)
SMOKE = ("1f1b", "interleaved-1f1b")  # --smoke: one schedule of one chunk per rank, one of several
LOSS_RTOL = 1e-5
ROUNDS = {"toy": (9, 2), "default": (5, 1)}  # size -> measured steps and warm-up per variant (make bench's budget)


@dataclass(frozen=True)
class Setup:
    """Model and run sizes; the same on every worker."""

    layers: int
    hidden: int
    seq: int
    micro_batch_size: int
    microbatches: int
    warmup: int
    rounds: int
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    shm: bool = True  # also time Sluice on its shared-memory transport
    pp: int = 4
    threads: int | None = None  # torch threads per worker; None: torch's default


def dense_model(setup: Setup) -> MiniMindForCausalLM:
    """The MiniMind-3 shape (vocab 6400, 8 heads, 4 KV heads, tied embeddings) at the benchmark's size."""
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig(hidden_size=setup.hidden, num_hidden_layers=setup.layers,
                                              max_position_embeddings=max(setup.seq, 512)))


def batches(setup: Setup, vocab: int) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(1)
    shape = (setup.micro_batch_size, setup.seq)
    return stamped([MicroBatch(ids, ids.clone()) for ids in
                    (torch.randint(0, vocab, shape, generator=gen) for _ in range(setup.microbatches))])


def worker(rank: int, world: int, setup: Setup) -> dict | None:
    """Both frameworks on every schedule, alternated; then one metered step each. Rank 0 returns the figures."""
    from torch_pipe import build

    pp = setup.pp
    if setup.threads:
        torch.set_num_threads(setup.threads)
    grid = ParallelGrid.build(dp=1, tp=1, pp=pp, backend="gloo", timeout_s=600)
    embed_group = dist.new_group([0, pp - 1])  # torch's tied-embedding pair (every rank must create it)
    model = dense_model(setup)
    micro = batches(setup, model.config.vocab_size)
    tokens = sum(mb.num_label_tokens() for mb in micro)
    sluice, theirs, variants = {}, {}, {}
    for name in setup.schedules:
        vpp = REGISTRY[name].default_vpp
        spec = default_engine_spec(PipelineSpec(pp=pp, vpp=vpp, schedule=name, n_microbatches=setup.microbatches),
                          setup.micro_batch_size, setup.seq)
        sluice[name] = build_engine(replace(spec, transport="p2p"), decoder_of(model), grid)
        theirs[name] = build(name, model, pp, setup.microbatches, grid.pp_rank, tokens, embed_group)
        variants[f"sluice {name}"] = lambda e=sluice[name]: _sluice_step(e, micro)
        variants[f"torch {name}"] = lambda t=theirs[name]: t.step(micro, tokens)
        if setup.shm:
            variants[f"sluice_shm {name}"] = lambda e=build_engine(replace(spec, transport="shm"), decoder_of(model),
                                                                   grid): _sluice_step(e, micro)
    times = alternate(variants, setup.warmup, setup.rounds)
    out = {}
    for name in setup.schedules:
        sluice_loss = _sluice_step(sluice[name], micro)
        registered = REGISTRY[name]
        last = stage_to_rank(pp * registered.default_vpp - 1, pp, registered.placement)  # rank 0 under the V
        torch_loss = _from_last(theirs[name].step(micro, tokens), last)
        shm = times[f"sluice_shm {name}"].summary("sluice_shm") if setup.shm else {}
        out[name] = {**times[f"sluice {name}"].summary("sluice"), **times[f"torch {name}"].summary("torch"), **shm,
                     "sluice_loss": sluice_loss, "torch_loss": torch_loss,
                     "sluice_peak_bytes": _gathered(_peak(lambda e=sluice[name]: _sluice_step(e, micro),
                                                          [boundary(s.chunk) for s in sluice[name].stages.values()])),
                     "torch_peak_bytes": _gathered(_peak(lambda t=theirs[name]: t.step(micro, tokens),
                                                         [boundary(m.decoder) for m in theirs[name].modules]))}
    return out if rank == 0 else None


def _sluice_step(engine, micro: list[MicroBatch]) -> float:
    for param in engine.parameters():
        param.grad = None  # as torch's step does: every step starts from empty gradients
    return engine.step(micro).loss


def _peak(step, modules: list) -> int:
    """Peak activation bytes on this rank during one step."""
    meter = ActivationMeter()
    hooks = watch_outputs(modules, meter)
    with meter.saved_tensors():
        step()
    for hook in hooks:
        hook.remove()
    return meter.peak


def _gathered(value) -> list:
    """Every rank's value, by pipeline rank (all ranks call this)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _from_last(value: float | None, last: int) -> float:
    """The last stage's value (on pipeline rank `last`), on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=last)
    return box[0]


def summarise(by_name: dict) -> tuple[dict, dict]:
    """results.json's "real" and "memory" sections."""
    real, memory = {}, {}
    for name, r in by_name.items():
        equal = abs(r["sluice_loss"] - r["torch_loss"]) <= LOSS_RTOL * abs(r["torch_loss"])
        real[name] = {"sluice_over_torch": r["sluice_s"] / r["torch_s"], "losses_equal": equal, **paired(r),
                      **({"sluice_shm_over_torch": r["sluice_shm_s"] / r["torch_s"]} if "sluice_shm_s" in r else {}),
                      **{k: v for k, v in r.items() if not k.endswith("peak_bytes")}}
        memory[name] = {"sluice_peak_bytes": r["sluice_peak_bytes"], "torch_peak_bytes": r["torch_peak_bytes"]}
    return real, memory


def main(argv: list[str]) -> tuple[dict, dict]:
    parser = bench_parser(__doc__, f"tiny model, 1 round, {' and '.join(SMOKE)} unless --schedules: checks the script "
                          "works", rounds=None)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES))
    parser.add_argument("--size", choices=("toy", "default"), default="toy")
    parser.add_argument("--pp", type=int, default=4)
    args = parser.parse_args(argv)
    schedules = tuple(args.schedules or SCHEDULES)
    rounds, warmup = (given if given is not None else fallback
                      for given, fallback in zip((args.rounds, args.warmup), ROUNDS[args.size]))
    if args.smoke:
        setup = Setup(8, 64, 16, 1, 4, 1, 1, tuple(args.schedules or SMOKE),
                      shm=args.size == "toy", pp=args.pp)
    elif args.size == "default":
        # 2 micro-batches per rank of sequence 64: a step of 1-2 s on 2 cores, so the whole size fits the bench. The
        # cores are shared out between the ranks: matmul-bound steps of oversubscribed threads wandered by 15%.
        setup = Setup(8, 768, 64, args.micro_batch_size, 2 * args.pp, warmup, rounds, schedules, shm=False,
                      pp=args.pp, threads=max((os.cpu_count() or 1) // args.pp, 1))
    else:
        setup = Setup(8, 256, 128, args.micro_batch_size, 8, warmup, rounds, schedules, pp=args.pp)
    real, memory = summarise(run_workers(worker, setup.pp, setup, timeout=1200)[0])
    if args.size == "default":
        full = _section(args.results, "full_size")
        full.update({f"pp{setup.pp} {name}": {**r, **memory[name]} for name, r in real.items()})
        full[f"setup pp{setup.pp}"] = asdict(setup)
        update_results("full_size", full, args.results)
    else:
        update_results("real", {**real, "setup": asdict(setup)}, args.results)
        update_results("memory", memory, args.results)
    print(f"{'schedule':18s} {'sluice s':>9s} {'torch s':>8s} {'ratio':>6s}  {'paired ms':>9s} {'wins':>5s}  "
          f"{'shm ratio':>9s}  {'sluice loss':>12s} {'torch loss':>12s}")
    for name, r in real.items():
        print(f"{name:18s} {r['sluice_s']:9.3f} {r['torch_s']:8.3f} {r['sluice_over_torch']:6.3f}  "
              f"{r['paired_diff_ms']:+9.2f} {r['sluice_wins']:>2d}/{r['rounds']:<2d}  "
              f"{r.get('sluice_shm_over_torch', float('nan')):9.3f}  "
              f"{r['sluice_loss']:12.6f} {r['torch_loss']:12.6f}  equal={r['losses_equal']}")
    for name, r in memory.items():
        print(f"{name:18s} peak activation MiB per stage: sluice "
              f"{[round(b / 2**20, 2) for b in r['sluice_peak_bytes']]}, torch "
              f"{[round(b / 2**20, 2) for b in r['torch_peak_bytes']]}")
    return real, memory


def _section(path: Path, name: str) -> dict:
    """One section of results.json as it stands (empty if absent)."""
    return json.loads(path.read_text()).get(name, {}) if path.exists() else {}


if __name__ == "__main__":
    main(sys.argv[1:])
