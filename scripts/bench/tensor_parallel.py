"""Tensor parallelism against DTensor: Sluice at tp=2 (its column/row/vocab-parallel layers and vocab-parallel
cross-entropy) and the loop a PyTorch user writes with `parallelize_module` on the same plan and `loss_parallel`,
on the same untied MiniMind, micro-batches, dtype, grad-norm clipping (max norm 1.0 on both sides) and AdamW
settings. Writes the "tensor_parallel" section of results.json.

The torch plan mirrors MiniMind's `base_model_tp_plan`: q/k/v, gate and up `ColwiseParallel`, o and down
`RowwiseParallel`, the embedding `RowwiseParallel(input_layouts=Replicate())` (vocab rows split, as Sluice's
vocab-parallel embedding), the LM head `ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)` with the
loss under `loss_parallel()`; the per-head q/k norms `SequenceParallel(sequence_dim=2)` on the head dim (torchtitan's
Qwen3 plan: q/k projections hand it DTensors, so DTensor sums the norms' partial gradients, as Sluice's
`replicated_with_grad_allreduce` hook does). No sequence parallelism: the residual stream and its norms stay plain,
replicated tensors on both sides. `torch.nn.utils.clip_grad_norm_` refuses a list mixing DTensor and plain gradients,
so torch's side takes each kind's norm apart (`get_total_norm`, the DTensor one made whole with `full_tensor()` as
torchtitan's clipping does) and clips both with their total.

Step time: both variants in the same two processes, one step each per round (A B, then B A) after a warm-up; the first
loss and the loss after all timed steps must agree (the same weights, data and updates). Memory: each variant alone
in two fresh processes, the peak resident set (VmHWM) of its fullest rank over three steps above what the process
held before the model was built, glibc returning freed memory at once (`common.freed_to_the_system`); the build's
own peak is kept apart (both sides build the dense model first, which the trainer does not). On CUDA the peaks of
allocated device memory instead. The device is CUDA (NCCL) when there is one, else the CPU (gloo); `--profile`
prints one step's top operators of each side.

    python scripts/bench/tensor_parallel.py [--smoke] [--rounds N] [--warmup N] [--results PATH] [--profile]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LoopStep, freed_to_the_system, resident_kib, run_workers  # noqa: E402
from harness import bench_parser, first_then_alternate, paired, update_results  # noqa: E402
from overhead import GRAD_CLIP, STEPS  # noqa: E402
from vs_torch import Setup, batches  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,  # noqa: E402
                                               loss_parallel, parallelize_module)

from minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from models import decoder_of  # noqa: E402
from parallel.engine import build_engine  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from parallel.spec import PipelineSpec  # noqa: E402
from parallel.step import IGNORE_INDEX, MicroBatch  # noqa: E402
from training.config.schema import OptimSchema  # noqa: E402
from training.optim import build_optimizer, lr_at  # noqa: E402
from training.specs import default_engine_spec  # noqa: E402

TP = 2
SIDES = ("sluice", "torch")
FIRST_RTOL = 1e-5  # the first step: the same weights and data
LAST_RTOL = 1e-4  # after every timed step: two TP implementations' fp32 sums in different orders, through AdamW


def dense_model(setup: Setup) -> MiniMindForCausalLM:
    """MiniMind-3's shape (vocab 6400, 8 heads, 4 KV heads) at the benchmark's size, embedding and head untied."""
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig(hidden_size=setup.hidden, num_hidden_layers=setup.layers,
                                              max_position_embeddings=max(setup.seq, 512), tie_word_embeddings=False))


def tp_grid() -> ParallelGrid:
    """The tp=2 grid of both sides: NCCL on this rank's GPU when CUDA is there, else gloo on the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() < TP:
        raise SystemExit(f"tensor_parallel.py: tp={TP} on CUDA needs {TP} GPUs, this machine has "
                         f"{torch.cuda.device_count()}; run it on a machine with {TP} or on the CPU")
    return ParallelGrid.build(dp=1, tp=TP, pp=1, backend="auto", timeout_s=600)


class SluiceTP(LoopStep):
    """The Trainer's step at tp=2: the TP pass's sharded layers and vocab-parallel loss, clipping, AdamW."""

    def __init__(self, setup: Setup, optim_cfg, grid: ParallelGrid):
        spec = default_engine_spec(PipelineSpec(n_microbatches=setup.microbatches), setup.micro_batch_size, setup.seq)
        engine = build_engine(spec, decoder_of(dense_model(setup)), grid)
        super().__init__(engine, build_optimizer(engine.parameters(), optim_cfg), grid, optim_cfg, STEPS, GRAD_CLIP)


def torch_plan(model: MiniMindForCausalLM) -> dict:
    """`parallelize_module`'s plan for MiniMind, the same split as its `base_model_tp_plan` and Sluice's head."""
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in model.model.layers:
        layer = f"model.layers.{i}"
        plan |= {f"{layer}.self_attn.q_proj": ColwiseParallel(use_local_output=False),
                 f"{layer}.self_attn.k_proj": ColwiseParallel(use_local_output=False),
                 f"{layer}.self_attn.v_proj": ColwiseParallel(),
                 # The [B, S, heads, head_dim] view of a q/k DTensor is sharded on heads (dim 2): the norm's weight
                 # is replicated and DTensor sums its partial gradient; the output is local for RoPE and SDPA.
                 f"{layer}.self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                 f"{layer}.self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                 f"{layer}.self_attn.o_proj": RowwiseParallel(),
                 f"{layer}.mlp.gate_proj": ColwiseParallel(),
                 f"{layer}.mlp.up_proj": ColwiseParallel(),
                 f"{layer}.mlp.down_proj": RowwiseParallel()}
    return plan


def clip_grad_norm_mixed_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` over DTensor and plain gradients together (it refuses a list mixing them): each kind's
    norm apart, the DTensor one made whole, both clipped with their total."""
    grads = [p.grad for p in params if p.grad is not None]
    kinds = ([g for g in grads if isinstance(g, DTensor)], [g for g in grads if not isinstance(g, DTensor)])
    norms = [torch.nn.utils.get_total_norm(kind) for kind in kinds if kind]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    for kind in kinds:
        if kind:  # clip_grads_with_norm_ takes parameters: hand it holders of these gradients
            torch.nn.utils.clip_grads_with_norm_([_Holder(g) for g in kind], max_norm, total)
    return total


class _Holder:
    """What `clip_grads_with_norm_` reads of a parameter: its `.grad`."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad


class DTensorStep:
    """What a PyTorch user writes: `parallelize_module` on the dense model, the loss under `loss_parallel`,
    gradient accumulation, clipping, AdamW (weight decay on matrices only, as Sluice's)."""

    def __init__(self, setup: Setup, optim_cfg, grid: ParallelGrid):
        self.device = grid.device
        model = dense_model(setup).to(self.device)
        self.model = parallelize_module(model, grid.mesh["tp"], torch_plan(model))
        self.params = list(self.model.parameters())
        groups = [{"params": [p for p in self.params if p.dim() >= 2], "weight_decay": optim_cfg.weight_decay},
                  {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps)
        self.cfg, self.step_no = optim_cfg, 0

    def __call__(self, micro: list[MicroBatch]) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step_no, STEPS, self.cfg)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with loss_parallel():  # the backward too must run inside it
            for mb in micro:
                logits = self.model(input_ids=mb.input_ids.to(self.device)).logits  # [B, S, V] sharded on V
                labels = mb.labels.to(self.device)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                       ignore_index=IGNORE_INDEX, reduction="sum") / mb.global_tokens
                del logits
                loss.backward()
                total += loss.detach().to_local().double()  # replicated: the whole loss on every rank
        clip_grad_norm_mixed_(self.params, GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_no += 1
        return float(total)


def build(side: str, setup: Setup, optim_cfg, grid: ParallelGrid) -> Callable[[list[MicroBatch]], float]:
    step = SluiceTP(setup, optim_cfg, grid) if side == "sluice" else DTensorStep(setup, optim_cfg, grid)
    if grid.device.type != "cuda":
        return step

    def synced(micro: list[MicroBatch]) -> float:  # a step's time includes its last kernels
        loss = step(micro)
        torch.cuda.synchronize(grid.device)
        return loss

    return synced


def timing_worker(rank: int, world: int, setup: Setup, profile: bool) -> dict:
    grid = tp_grid()
    optim_cfg = OmegaConf.structured(OptimSchema)
    micro = batches(setup, dense_model(setup).config.vocab_size)
    steps = {side: build(side, setup, optim_cfg, grid) for side in SIDES}
    out = first_then_alternate(steps, micro, setup.warmup, setup.rounds)
    out["last_loss"] = {side: step(micro) for side, step in steps.items()}  # after as many updates on each side
    if profile:
        out["profile"] = {side: top_ops(step, micro) for side, step in steps.items()}
    return out


def top_ops(step: Callable, micro: list[MicroBatch], rows: int = 15) -> str:
    """One step's operators on this rank by self time on the device that computes (torch.profiler's table)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        step(micro)
    return prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                     row_limit=rows)


def memory_worker(rank: int, world: int, setup: Setup, side: str) -> dict:
    """One variant alone: its peak memory above what the process held before building it, over the build and over
    three steps after it (MiB)."""
    grid = tp_grid()
    optim_cfg = OmegaConf.structured(OptimSchema)
    micro = batches(setup, dense_model(setup).config.vocab_size)
    device = grid.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step = build(side, setup, optim_cfg, grid)
        built = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(3):
            step(micro)
        peaks = (built - before, torch.cuda.max_memory_allocated(device) - before)
        return {"build": peaks[0] / 2**20, "steps": peaks[1] / 2**20}
    before = resident_kib("VmRSS")
    step = build(side, setup, optim_cfg, grid)
    built = resident_kib("VmHWM")
    reset_peak_resident()
    for _ in range(3):
        step(micro)
    return {"build": (built - before) / 1024, "steps": (resident_kib("VmHWM") - before) / 1024}


def reset_peak_resident() -> None:
    """Set this process's VmHWM back to its resident set now (Linux: /proc/self/clear_refs), so that the steps' peak
    is their own, not the build's (the benchmark builds each side from a dense model first)."""
    Path("/proc/self/clear_refs").write_text("5")


def close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * abs(b)


def summarise(ours: dict, peaks: dict[str, list[dict]], setup: Setup, device: str) -> dict:
    """The section: step-time medians and paired rounds, the fullest rank's peak memory over the steps (and each
    rank's, over the steps and over the build), the loss checks."""
    row = {**ours["times"]["sluice"].summary("sluice"), **ours["times"]["torch"].summary("torch")}
    memory = {side: max(rank["steps"] for rank in by_rank) for side, by_rank in peaks.items()}
    build_memory = {side: max(rank["build"] for rank in by_rank) for side, by_rank in peaks.items()}
    # None where torch's side shows no growth: only in reused processes (the tests' pooled workers)
    memory_ratio = memory["sluice"] / memory["torch"] if memory["torch"] > 0 else None
    first, last = ours["first_loss"], ours["last_loss"]
    return {"tp": TP, "device": device, "sluice_over_torch": row["sluice_s"] / row["torch_s"], **row, **paired(row),
            "peak_mib": memory, "memory_over_torch": memory_ratio,
            "build_peak_mib": build_memory, "peak_mib_by_rank": peaks,
            "first_loss": first, "last_loss": last, "steps_to_last": 2 + setup.warmup + setup.rounds,
            "losses_equal": close(first["sluice"], first["torch"], FIRST_RTOL),
            "last_losses_close": close(last["sluice"], last["torch"], LAST_RTOL), "first_rtol": FIRST_RTOL,
            "last_rtol": LAST_RTOL, "grad_clip": GRAD_CLIP, "setup": asdict(setup)}


def main(argv: list[str]) -> dict:
    parser = bench_parser(__doc__, "tiny model, 1 round: checks the script works", rounds=6, warmup=1)
    parser.add_argument("--profile", action="store_true", help="print one step's top operators of each side (rank 0)")
    args = parser.parse_args(argv)
    if args.smoke:
        setup = Setup(layers=2, hidden=64, seq=16, micro_batch_size=1, microbatches=2, warmup=1, rounds=1)
    else:
        setup = Setup(8, 768, 128, 1, 2, args.warmup, args.rounds)
    ours = run_workers(timing_worker, TP, setup, args.profile, timeout=1800)[0]
    with freed_to_the_system():
        peaks = {side: run_workers(memory_worker, TP, setup, side, timeout=1800) for side in SIDES}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    section = summarise(ours, peaks, setup, device)
    memory, ratio = section["peak_mib"], section["memory_over_torch"]
    update_results("tensor_parallel", section, args.results)
    print(f"tp{TP} on {device}: sluice {section['sluice_s']:.3f} s, torch {section['torch_s']:.3f} s (ratio "
          f"{section['sluice_over_torch']:.3f}, Sluice faster in {section['sluice_wins']} of {section['rounds']} "
          f"rounds); peak memory per rank over the steps {memory['sluice']:.1f} vs {memory['torch']:.1f} MiB (ratio "
          f"{'—' if ratio is None else f'{ratio:.3f}'}), over the build {section['build_peak_mib']}; first loss "
          f"{section['first_loss']} (equal: {section['losses_equal']}), at step {section['steps_to_last']} "
          f"{section['last_loss']} (close: {section['last_losses_close']})")
    for side, table in ours.get("profile", {}).items():
        print(f"== {side}: one step on rank 0, top operators by self time\n{table}")
    return section


if __name__ == "__main__":
    main(sys.argv[1:])
