"""Turn bench/results.json into docs/benchmarks.md: machine, command, medians, ratios, acceptance, timelines."""

from __future__ import annotations

import json
import os
from pathlib import Path

from report_fsdp import fsdp_acceptance, fsdp_section
from report_rollout import rollout_acceptance, rollout_section
from report_speedups import compiled_section, sizes_section

MIB = 2**20
METHOD = """\
How it is measured. Every time is a median over steps; variants run alternately, one step each per round, after
warm-up steps that are not counted, so a noisy neighbour hits all of them alike: A B A B, and since 7a41764 A B
then B A (a step's slot in the round biases it, so each side takes both slots; the compile measurements and the
size sweep's DP columns were taken so). A step's time is the slowest rank's, from a barrier to the end of its
step. The processes are 4 gloo workers with one thread each on this machine's cores. CPU time (all ranks
together) is given beside wall time: it is what a step costs whatever else the machine runs, so it separates
framework work from a busy neighbour.

- **Sleep benchmark** (`scripts/bench/schedules.py`): every stage is one layer whose forward, input-gradient
  and weight-gradient passes sleep a fixed time (no CPU): f is one rank's share of the model (b = 2f, i = w = f;
  with two chunks per rank each chunk sleeps half). The ideal is the simulator's makespan
  (`LoweredPipeline.simulate`, zero communication cost) for the stage costs measured before the run: rank 0 times
  each stage's F and B alone, with plain autograd and no pipeline runtime, while the other ranks wait, and B
  splits into I and W as its sleeps do. A stage's action is its sleep plus the model code around it
  (embedding, head, loss, autograd; code that runs right after a sleep is slow on this machine), so about 3%
  above the sleep; no runtime can go below that, and the distance to this ideal is what scheduling and
  transport cost. The nominal ideal (each action exactly its sleep) is given beside it.
  torch.distributed.pipelining runs the same stage modules and is divided by the same ideal as Sluice's
  schedule of the same name (zb-h1 is compared with torch's ScheduleInterleavedZeroBubble on one stage per
  rank, zbv with ScheduleZBVZeroBubble).
- **Real model** (`scripts/bench/vs_torch.py`): MiniMind (vocab 6400, 8 layers, hidden 256, 8 heads, 4 KV
  heads, tied embeddings), seq 128, fp32, pp=4, 8 micro-batches. torch's stages are pruned from the dense
  model exactly as Sluice prunes them (`prune_to_stage`), behind a one-tensor stage interface, with the same
  token-sum loss over the global token count (`scale_grads=False`) and the same tied-embedding gradient sum
  after the step. A step is forward + backward (+ that sum); the optimizer is the same for both and left out.
  `--size default` repeats it at MiniMind-3's default size (hidden 768) at pp2 and pp4, over gloo only.
- **Activation memory**: peak bytes alive at once per pipeline rank during one step: every tensor autograd
  saves for backward (saved-tensor hooks, each storage once) plus each stage's boundary output while a
  Python object still holds it. Sluice's deferred weight-gradient inputs (zero-bubble) are not counted.
- **Transports**: torch.distributed.pipelining passes boundary tensors over gloo on CPUs. Sluice's default on one
  CPU host is shared memory (`parallel.transport=auto`); the sleep benchmark times Sluice so, and at the
  smallest m over gloo too. The real-model comparison runs both over gloo and gives Sluice on shared memory
  beside them. `scripts/bench/hop_latency.py` times one hop of each transport.
- **Overhead** (`scripts/bench/overhead.py`): one process, the real model; a Sluice step (LocalEngine, the
  trainer's learning rate, grad-norm clipping and AdamW) against a hand-written loop (forward, backward per
  micro-batch, `clip_grad_norm_`, AdamW with the same settings).
"""


def write(results_path: Path, doc_path: Path, command: str, root: Path) -> Path:
    """Write the markdown page for the results in `results_path`."""
    r = json.loads(results_path.read_text())
    lines = ["# Benchmarks", "", f"Measured with `{command}` on {_machine(r)}.", ""]
    run = r.get("run", {})
    if run:
        took = ", ".join(f"{entry.removesuffix('.py')} {s:.0f} s" for entry, s in run.get("took_s", {}).items())
        lines += [f"Run finished {run.get('finished', '?')}, took {run.get('wall_s', 0) / 60:.1f} min"
                  + (f" ({took})." if took else "."), ""]
    lines += _acceptance(r) + _sleep(r, doc_path, root) + _real(r) + _full_size(r) + _memory(r) + _overhead(r)
    lines += rollout_section(r)
    lines += _transport(r) + _experts(r) + _data_parallel(r) + fsdp_section(r) + _tensor_parallel(r) + _recompute(r)
    lines += compiled_section(r)
    lines += sizes_section(r, doc_path, root, _machine(r))
    lines += ["## Method", "", METHOD]
    doc_path.parent.mkdir(parents=True, exist_ok=True)
    doc_path.write_text("\n".join(lines))
    return doc_path


def _machine(r: dict) -> str:
    m = r.get("machine", {})
    return f"{m.get('cores')} CPU cores ({m.get('cpu')}), Python {m.get('python')}, torch {m.get('torch')}"


def _acceptance(r: dict) -> list[str]:
    rows = []
    sleep = _schedules(r.get("sleep", {}))
    if sleep:
        worst = max(sleep, key=lambda k: sleep[k]["sluice_over_ideal"])
        m = next(iter(sleep.values()))["m"]
        rows.append((f"every Sluice schedule within 1.05x of the ideal (sleep, m={m})",
                     f"worst {worst} {sleep[worst]['sluice_over_ideal']:.3f}",
                     all(v["sluice_over_ideal"] <= 1.05 for v in sleep.values())))
        behind = [k for k, v in sleep.items() if v["torch_over_ideal"] is not None
                  and v["sluice_over_ideal"] > v["torch_over_ideal"]]
        rows.append((f"Sluice's ratio at or below torch's for every schedule (sleep, m={m})",
                     "behind on " + ", ".join(behind) if behind else "all", not behind))
    full = {k: v for k, v in r.get("full_size", {}).items() if not k.startswith("setup")}
    if full:
        rows.append(("pipeline at the default size (pp2, pp4): Sluice at most 1.0x torch in step time and peak "
                     "activations, equal losses", ", ".join(f"{k} {v['sluice_over_torch']:.3f}" for k, v in full.items()),
                     all(v["sluice_over_torch"] <= 1.0 and v["losses_equal"]
                         and max(v["sluice_peak_bytes"]) <= max(v["torch_peak_bytes"]) for v in full.values())))
    real = _schedules(r.get("real", {}))
    if real:
        rows.append(("real model: Sluice at most 1.0x torch, equal losses",
                     ", ".join(f"{k} {v['sluice_over_torch']:.3f}" for k, v in real.items()),
                     all(v["sluice_over_torch"] <= 1.0 and v["losses_equal"] for v in real.values())))
    mem = r.get("memory", {}).get("1f1b")
    if mem:
        rows.append(("1F1B peak activation memory per stage at most torch's",
                     f"{_mib(mem['sluice_peak_bytes'])} vs {_mib(mem['torch_peak_bytes'])} MiB",
                     all(s <= t for s, t in zip(mem["sluice_peak_bytes"], mem["torch_peak_bytes"]))))
    if "overhead" in r:
        rows.append(("single-process overhead ratio at most 1.03", f"{r['overhead']['ratio']:.3f}",
                     r["overhead"]["ratio"] <= 1.03))
    if "experts" in r:
        e = r["experts"]
        rows.append((f"ep{e['ep']} memory per rank falls by at least the expert share x (1 - 1/ep), equal losses",
                     f"fall {e['memory_fall']:.3f}, required {e['required_fall']:.3f}",
                     e["memory_met"] and e["losses_equal"]))
    for name, row in r.get("data_parallel", {}).get("rows", {}).items():
        peer = PEERS[name]
        rows.append((f"Sluice {name} at most 1.00x {peer} in step time and peak memory, equal losses",
                     f"step {row['sluice_over_torch']:.3f}, memory {row['memory_over_torch']:.3f}",
                     row["sluice_over_torch"] <= 1.0 and row["memory_over_torch"] <= 1.0 and row["losses_equal"]))
    rows += fsdp_acceptance(r)
    if "tensor_parallel" in r:
        t = r["tensor_parallel"]
        rows.append((f"Sluice tp{t['tp']} at most 1.00x DTensor `parallelize_module` + `loss_parallel` in step time "
                     "and peak memory, equal losses",
                     f"step {t['sluice_over_torch']:.3f}, memory {_ratio(t['memory_over_torch'])}",
                     t["sluice_over_torch"] <= 1.0 and t["memory_over_torch"] is not None
                     and t["memory_over_torch"] <= 1.0 and t["losses_equal"] and t["last_losses_close"]))
    if "recompute" in r:
        c = r["recompute"]
        rows.append(("`train.recompute=full` at most 1.00x `torch.utils.checkpoint` per layer in step time and peak "
                     "memory, equal losses", f"step {c['full_over_checkpoint']:.3f}, memory "
                     f"{c['memory_full_over_checkpoint']:.3f}", c["full_over_checkpoint"] <= 1.0
                     and c["memory_full_over_checkpoint"] <= 1.0 and c["losses_equal"]))
    if "compiled" in r:
        c = r["compiled"]
        rows.append(("`train.compile=true` at least 1.15x tokens/s over eager, one process, default size",
                     f"{c['default_one_process_speedup']:.3f}", c["default_one_process_speedup"] >= 1.15))
        rows.append(("no layout slower compiled than eager", ", ".join(f"{row['name']} {row['speedup']:.3f}"
                                                                     for row in c["rows"]), c["none_slower"]))
    sizes = r.get("sizes")
    if sizes and sizes.get("worst"):
        w = sizes["worst"]
        rows.append((f"every cell of the size sweep ({len(sizes['cells'])} cells): Sluice / peer at most 1.00 + the "
                     "cell's spread", f"worst {w['comparison']} at {w['cell']}: {w['ratio']:.3f} ± {w['spread']:.3f}",
                     sizes["within_spread"]))
    rows += rollout_acceptance(r)
    out = ["## Acceptance", "", "| criterion | measured | met |", "|---|---|---|"]
    out += [f"| {c} | {m} | {'yes' if ok else '**no**'} |" for c, m, ok in rows]
    return out + [""]


def _sleep(r: dict, doc_path: Path, root: Path) -> list[str]:
    sleep = r.get("sleep")
    if not sleep:
        return []
    setup = sleep.get("setup", {})
    out = ["## Sleep benchmark: measured / ideal (pp=4)", "",
           f"f = {setup.get('f_s', 0) * 1000:.0f} ms per rank's share of the model, b = 2f, i = w = f; "
           f"{setup.get('rounds')} measured steps per variant after {setup.get('warmup')} warm-up. The ideal is "
           "for the stage costs measured alone (Method); the nominal one takes each action as exactly its sleep. "
           "Each round runs one Sluice step and one torch step back to back: \"Sluice − torch\" is the median of "
           "those paired differences, and \"Sluice faster\" counts the rounds Sluice won. Sluice runs with its "
           f"default transport ({_transport_name(sleep)}); torch with gloo. \"Sluice on gloo\" is Sluice with "
           "`parallel.transport=p2p`, as torch passes tensors: the runtime's share without the transport's.",
           "", "| schedule | m | ideal (s) | Sluice (s) | torch (s) | Sluice / ideal | torch / ideal | "
           "Sluice on gloo / ideal | nominal ideal (s) | Sluice / nominal | torch / nominal | Sluice − torch (ms) | "
           "Sluice faster |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in _schedules(sleep).items():
        for m, row in v["by_m"].items():
            out.append(f"| {name} | {m} | {row['ideal_s']:.3f} | {row['sluice_s']:.3f} | {row['torch_s']:.3f} | "
                       f"{row['sluice_over_ideal']:.3f} | {row['torch_over_ideal']:.3f} | "
                       f"{_ratio(row.get('sluice_gloo_over_ideal'))} | {row['nominal_ideal_s']:.3f} | {row['sluice_over_nominal']:.3f} | "
                       f"{row['torch_over_nominal']:.3f} | {row['paired_diff_ms']:+.1f} | "
                       f"{row['sluice_wins']}/{row['rounds']} |")
    pngs = [root / p for p in sleep.get("timelines", [])]
    if pngs:
        out += ["", "Measured Sluice steps (below) under the simulator's ideal step (above):", ""]
        out += [f"![{p.stem}]({os.path.relpath(p, doc_path.parent)})" for p in pngs]
    return out + [""]


def _real(r: dict) -> list[str]:
    real = r.get("real")
    if not real:
        return []
    s = real.get("setup", {})
    out = ["## Real model: Sluice / torch.distributed.pipelining (pp=4)", "",
           f"{s.get('layers')} layers, hidden {s.get('hidden')}, seq {s.get('seq')}, micro-batch size "
           f"{s.get('micro_batch_size')}, {s.get('microbatches')} micro-batches; {s.get('rounds')} measured steps "
           f"per variant after {s.get('warmup')} warm-up.", "",
           "Both pass boundary tensors over gloo (Sluice with `parallel.transport=p2p`); \"Sluice on shm / torch\" is "
           "Sluice with its default on one CPU host, shared memory.", "",
           "| schedule | Sluice (s) | torch (s) | Sluice / torch | Sluice − torch, paired (ms) | Sluice faster | "
           "Sluice on shm / torch | CPU s, Sluice / torch | Sluice loss | torch loss | equal |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in _schedules(real).items():
        out.append(f"| {name} | {v['sluice_s']:.3f} | {v['torch_s']:.3f} | {v['sluice_over_torch']:.3f} | "
                   f"{v['paired_diff_ms']:+.1f} | {v['sluice_wins']}/{v['rounds']} | "
                   f"{_ratio(v.get('sluice_shm_over_torch'))} | "
                   f"{v['sluice_cpu_s']:.3f} / {v['torch_cpu_s']:.3f} | {v['sluice_loss']:.6f} | "
                   f"{v['torch_loss']:.6f} | {'yes' if v['losses_equal'] else 'no'} |")
    return out + [""]


def _full_size(r: dict) -> list[str]:
    """The pipeline at MiniMind-3's default size, pp2 and pp4, against torch.distributed.pipelining."""
    full = {k: v for k, v in r.get("full_size", {}).items() if not k.startswith("setup")}
    if not full:
        return []
    setups = {k.removeprefix("setup "): v for k, v in r["full_size"].items() if k.startswith("setup")}
    s = next(iter(setups.values()))
    rounds = ", ".join(f"{pp}: {v.get('rounds')}" for pp, v in setups.items())
    out = ["## The pipeline at the default size: Sluice / torch.distributed.pipelining", "",
           f"MiniMind-3 as it ships ({s.get('layers')} layers, hidden {s.get('hidden')}, vocab 6400), seq "
           f"{s.get('seq')}, micro-batch size {s.get('micro_batch_size')}, 2 micro-batches per pipeline rank; "
           f"measured steps per variant ({rounds}) after {s.get('warmup')} warm-up, both over gloo "
           "(`scripts/bench/vs_torch.py --size default --pp N`). Peak activation memory is the largest rank's. The "
           "paired difference is the median of Sluice's step less torch's step next to it: where it and the ratio "
           "of medians disagree in sign, the two are within this machine's noise.", "",
           "| layout, schedule | Sluice (s) | torch (s) | Sluice / torch | paired diff (ms) | Sluice faster | peak "
           "activations Sluice / torch | Sluice loss | torch loss | equal |", "|---" * 10 + "|"]
    for name, v in full.items():
        peak = max(v["sluice_peak_bytes"]) / max(v["torch_peak_bytes"])
        out.append(f"| {name} | {v['sluice_s']:.3f} | {v['torch_s']:.3f} | {v['sluice_over_torch']:.3f} | "
                   f"{v['paired_diff_ms']:+.1f} | {v['sluice_wins']}/{v['rounds']} | {peak:.3f} | "
                   f"{v['sluice_loss']:.6f} | {v['torch_loss']:.6f} | {'yes' if v['losses_equal'] else 'no'} |")
    return out + [""]


def _memory(r: dict) -> list[str]:
    mem = r.get("memory")
    if not mem:
        return []
    out = ["## Peak activation memory per pipeline rank (MiB)", "",
           "| schedule | Sluice | torch |", "|---|---|---|"]
    out += [f"| {name} | {_mib(v['sluice_peak_bytes'])} | {_mib(v['torch_peak_bytes'])} |" for name, v in mem.items()]
    return out + [""]


def _overhead(r: dict) -> list[str]:
    o = r.get("overhead")
    if not o:
        return []
    clip = o.get("clip_cpu_s", {})
    out = ["## Single-process overhead", "", "| Sluice (s) | hand-written loop (s) | ratio | CPU-time ratio |",
           "|---|---|---|---|", f"| {o['sluice_s']:.3f} | {o['plain_s']:.3f} | {o['ratio']:.3f} | {o['cpu_ratio']:.3f} |"]
    if clip:
        out += ["", f"Grad-norm clipping alone, on the same gradients: {clip['sluice'] * 1000:.1f} ms of CPU in the "
                f"trainer's `clip_grad_norm`, {clip['torch'] * 1000:.1f} ms in `torch.nn.utils.clip_grad_norm_`."]
    return out + [""]


def _transport(r: dict) -> list[str]:
    t = r.get("transport")
    if not t:
        return []
    return ["## Transport: one hop between two ranks (µs)", "",
            f"Ping-pong of a {' x '.join(map(str, t['boundary']))} fp32 boundary tensor, each rank sleeping "
            f"{t['compute_s'] * 1000:.0f} ms before it sends (`scripts/bench/hop_latency.py`); median of "
            f"{t['rounds']} round trips each, alternated.", "",
            "| gloo P2P | shared memory | shared memory / gloo |", "|---|---|---|",
            f"| {t['gloo_hop_us']:.0f} | {t['shm_hop_us']:.0f} | {t['shm_over_gloo']:.2f} |", ""]


def _experts(r: dict) -> list[str]:
    e = r.get("experts")
    if not e:
        return []
    s, ep = e["setup"], e["ep"]
    mem = {name: e["memory_bytes"][name] / MIB for name in ("ep1", f"ep{ep}")}
    return [f"## Expert parallelism: ep={ep} against replicated experts (dp={e['dp']})", "",
            f"MiniMind-MoE, {s['layers']} layers, hidden {s['hidden']}, {s['experts']} experts of intermediate size "
            f"{s['expert_intermediate']}, top-{s['top_k']} (experts are {e['expert_share']:.1%} of a replicated rank's "
            f"bytes); "
            f"seq {s['seq']}, micro-batch size {s['micro_batch_size']}, {s['microbatches']} micro-batches per rank; "
            f"{s['rounds']} measured steps per variant after {s['warmup']} warm-up (`scripts/bench/experts.py`). "
            "A step is the Trainer's: forward, backward, gradient sync, clipping, AdamW. Memory is the fullest rank's "
            "parameters + gradients + AdamW state, counted tensor by tensor.", "",
            "| variant | step (s) | CPU s (all ranks) | memory per rank (MiB) |", "|---|---|---|---|",
            f"| replicated (ep=1) | {e['ep1_s']:.3f} | {e['ep1_cpu_s']:.3f} | {mem['ep1']:.1f} |",
            f"| ep={ep} | {e[f'ep{ep}_s']:.3f} | {e[f'ep{ep}_cpu_s']:.3f} | {mem[f'ep{ep}']:.1f} |", "",
            f"ep={ep} / replicated: step time {e['ep_over_replicated']:.3f}, memory {1 - e['memory_fall']:.3f} "
            f"(a fall of {e['memory_fall']:.3f}; the experts' share x (1 - 1/ep) is {e['required_fall']:.3f}). "
            "First losses " + ", ".join(f"{v:.6f} at ep={k}" for k, v in e["first_loss"].items())
            + f" ({'equal to 1e-5' if e['losses_equal'] else '**not equal**'}).", ""]


PEERS = {"dp": "DistributedDataParallel", "zero1": "DDP + ZeroRedundancyOptimizer"}  # data_parallel.py's rows


def _data_parallel(r: dict) -> list[str]:
    d = r.get("data_parallel")
    if not d:
        return []
    s = d["setup"]
    out = [f"## Data parallelism against DistributedDataParallel (dp={d['dp']})", "",
           f"MiniMind, {s['layers']} layers, hidden {s['hidden']}, seq {s['seq']}, micro-batch size "
           f"{s['micro_batch_size']}, {s['microbatches']} micro-batches per replica; fp32 on gloo; buckets of "
           f"{d['bucket_mb']} MiB on both sides (`scripts/bench/data_parallel.py`). Sluice's step is its engine's "
           "(gradient sums started by post-accumulate hooks while the backward runs) with its clipping and AdamW; "
           "torch's is a DDP loop (`no_sync` until the last micro-batch, `clip_grad_norm_`, AdamW), with "
           "`ZeroRedundancyOptimizer` for `zero1`. Step times alternate in the same processes "
           f"({s['rounds']} rounds after {s['warmup']} warm-up); peak memory is each variant alone in fresh processes: "
           "the fullest rank's peak resident set over three steps above what it held before building the model (glibc "
           "returning freed memory at once, so the resident set follows the live tensors).", "",
           "| comparison | Sluice step (s) | torch step (s) | Sluice / torch | Sluice faster in | Sluice peak (MiB) "
           "| torch peak (MiB) | memory Sluice / torch |", "|---|---|---|---|---|---|---|---|"]
    for name, row in d["rows"].items():
        out.append(f"| {name} vs {PEERS[name]} | {row['sluice_s']:.3f} | {row['torch_s']:.3f} | "
                   f"{row['sluice_over_torch']:.3f} | {row['sluice_wins']} of {row['rounds']} | "
                   f"{row['peak_mib']['sluice']:.1f} | {row['peak_mib']['torch']:.1f} | {row['memory_over_torch']:.3f} |")
    return out + [""]


def _tensor_parallel(r: dict) -> list[str]:
    t = r.get("tensor_parallel")
    if not t:
        return []
    s, tp = t["setup"], t["tp"]
    backend = "NCCL on CUDA" if t["device"] == "cuda" else "gloo on the CPU"
    memory = "peak allocated device memory" if t["device"] == "cuda" else "peak resident set (glibc returning " \
        "freed memory at once)"
    return [f"## Tensor parallelism against DTensor `parallelize_module` (tp={tp})", "",
            f"MiniMind with untied embedding and head, {s['layers']} layers, hidden {s['hidden']}, vocab 6400, seq "
            f"{s['seq']}, micro-batch size {s['micro_batch_size']}, {s['microbatches']} micro-batches; fp32, {backend} "
            "(`scripts/bench/tensor_parallel.py`). Sluice's step is its engine's (column/row/vocab-parallel layers, "
            "vocab-parallel cross-entropy) with its clipping and AdamW; torch's applies `parallelize_module` with the "
            "same split (q/k/v, gate, up `ColwiseParallel`; o, down `RowwiseParallel`; the embedding "
            "`RowwiseParallel(input_layouts=Replicate())`; the head `ColwiseParallel(output_layouts=Shard(-1))` with "
            "the loss under `loss_parallel()`; the per-head q/k norms `SequenceParallel` on the head dim), "
            f"accumulates, clips (max norm {t['grad_clip']} on both sides) and steps AdamW. Step times alternate in "
            f"the same processes ({s['rounds']} rounds after {s['warmup']} warm-up). Peak memory is each variant "
            f"alone in fresh processes: the fullest rank's {memory} over three steps, above what it held before "
            "building the model. The peak of the build itself is given apart: both sides build the dense model "
            "first, and Sluice's engine shards a pruned deep copy of it (the trainer builds on the meta device "
            "instead and never holds it).", "",
            "| Sluice step (s) | torch step (s) | Sluice / torch | Sluice faster in | CPU s, Sluice / torch "
            "| Sluice peak (MiB) | torch peak (MiB) | memory Sluice / torch |", "|---|---|---|---|---|---|---|---|",
            f"| {t['sluice_s']:.3f} | {t['torch_s']:.3f} | {t['sluice_over_torch']:.3f} | {t['sluice_wins']} of "
            f"{t['rounds']} | {t['sluice_cpu_s']:.3f} / {t['torch_cpu_s']:.3f} | {t['peak_mib']['sluice']:.1f} | "
            f"{t['peak_mib']['torch']:.1f} | {_ratio(t['memory_over_torch'])} |", "",
            f"Building alone peaked at {t['build_peak_mib']['sluice']:.1f} MiB (Sluice) and "
            f"{t['build_peak_mib']['torch']:.1f} MiB (torch). "
            f"First losses {t['first_loss']['sluice']:.6f} and {t['first_loss']['torch']:.6f} "
            f"({'equal' if t['losses_equal'] else '**not equal**'} to {t['first_rtol']:g}); at step "
            f"{t['steps_to_last']} (the same data every step) {t['last_loss']['sluice']:.6f} and "
            f"{t['last_loss']['torch']:.6f} "
            f"({'equal' if t['last_losses_close'] else '**not equal**'} to {t['last_rtol']:g}).", ""]


def _recompute(r: dict) -> list[str]:
    c = r.get("recompute")
    if not c:
        return []
    s = c["setup"]
    out = ["## Recomputation against `torch.utils.checkpoint`", "",
           f"One process, MiniMind, {s['layers']} layers, hidden {s['hidden']}, seq {s['seq']}, micro-batch size "
           f"{s['micro_batch_size']}, {s['microbatches']} micro-batches; fp32 (`scripts/bench/recompute.py`). "
           "`torch_checkpoint` is the hand-written loop with each decoder layer's forward under non-reentrant "
           "`torch.utils.checkpoint`; the Sluice variants are its one-process step with `train.recompute`. Step "
           f"times alternate in one process ({s['rounds']} rounds after {s['warmup']} warm-up); peak memory is each "
           "variant alone in a fresh process, its peak resident set over three steps above what it held before "
           "building the model (glibc returning freed memory at once).", "", "| variant | step (s) | peak memory (MiB) |",
           "|---|---|---|"]
    out += [f"| {name} | {row['step_s']:.3f} | {row['peak_mib']:.1f} |" for name, row in c["rows"].items()]
    return out + ["", f"Full recomputation / `torch.utils.checkpoint`: step {c['full_over_checkpoint']:.3f}, "
                  f"memory {c['memory_full_over_checkpoint']:.3f}; first losses "
                  f"{'equal to 1e-5' if c['losses_equal'] else '**not equal**'}.", ""]


def _transport_name(sleep: dict) -> str:
    """The transport Sluice's sleep runs used, as the page names it."""
    names = {row.get("sluice_transport") for v in _schedules(sleep).values() for row in v["by_m"].values()}
    return ", ".join({"ShmTransport": "shared memory", "P2PTransport": "gloo"}.get(n, str(n)) for n in sorted(names))


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _schedules(section: dict) -> dict:
    """The per-schedule entries of a section (not its setup or file lists)."""
    return {k: v for k, v in section.items() if isinstance(v, dict) and k != "setup"}


def _mib(values: list[int]) -> str:
    return ", ".join(f"{b / MIB:.2f}" for b in values)
