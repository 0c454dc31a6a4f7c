"""Overhead of the single-process path: a Sluice step (pp=1, tp=1: LocalEngine plus the trainer's learning
rate, grad-norm clipping and AdamW) against a minimal hand-written PyTorch loop on the same model,
micro-batches and optimizer settings; the ratio of medians. Writes the "overhead" section of results.json.

Each variant runs in a process of its own and they take turns, one step each per round (A B, then B A) after a
warm-up, so only one computes at a time and the machine's drift hits both alike. Separate processes because
in one, the two models' allocations interleave in one heap: which variant then pays more page faults for its
fresh activations is luck of the layout, and it moved the ratio by several percent between runs.

    python scripts/bench/overhead.py [--smoke] [--rounds N] [--warmup N] [--results PATH]
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LoopStep, init_gloo, run_workers  # noqa: E402
from harness import bench_parser, repeated, take_turns, update_results  # noqa: E402
from vs_torch import Setup, batches, dense_model  # noqa: E402

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from models import decoder_of  # noqa: E402
from parallel.engine import build_engine  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from parallel.spec import PipelineSpec  # noqa: E402
from training.specs import default_engine_spec  # noqa: E402
from parallel.step import MicroBatch  # noqa: E402
from training.config.schema import OptimSchema  # noqa: E402
from training.objectives.lm import shifted_loss_sum  # noqa: E402
from training.optim import build_optimizer, clip_grad_norm, lr_at  # noqa: E402

GRAD_CLIP = 1.0
STEPS = 1000  # the learning-rate schedule's length: only where on it the benchmark sits matters, not its end


class SluiceStep(LoopStep):
    """What the Trainer does per step on one process, without data loading and logging."""

    def __init__(self, setup: Setup, optim_cfg):
        grid = ParallelGrid.single("cpu")
        spec = default_engine_spec(PipelineSpec(n_microbatches=setup.microbatches), setup.micro_batch_size, setup.seq)
        engine = build_engine(spec, decoder_of(dense_model(setup)), grid)
        super().__init__(engine, build_optimizer(engine.parameters(), optim_cfg), grid, optim_cfg, STEPS, GRAD_CLIP)


class PlainStep:
    """The loop a PyTorch user would write: accumulate over micro-batches, clip, AdamW."""

    def __init__(self, setup: Setup, optim_cfg):
        self.model = dense_model(setup)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                                           eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay)
        self.cfg, self.step_no = optim_cfg, 0

    def __call__(self, micro: list[MicroBatch]) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step_no, STEPS, self.cfg)
        tokens = sum(mb.num_label_tokens() for mb in micro)
        total = 0.0
        for mb in micro:
            loss = shifted_loss_sum(self.model(input_ids=mb.input_ids).logits, mb.labels) / tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_no += 1
        return total


def clip_costs(sluice: SluiceStep, repeats: int = 5) -> dict:
    """CPU seconds (median) of the trainer's grad-norm clipping and of torch's, on the same gradients."""
    params = sluice.engine.parameters()
    for param in params:
        param.grad = torch.full_like(param, 1e-3)
    runs = {"sluice": lambda: clip_grad_norm(params, params, GRAD_CLIP, None, sluice.grid.device),
            "torch": lambda: torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)}
    spent = {name: statistics.median(repeated(clip, repeats)[0].cpu) for name, clip in runs.items()}
    sluice.optimizer.zero_grad(set_to_none=True)
    return spent


def worker(rank: int, world: int, setup: Setup) -> dict:
    """Rank 0 runs Sluice's step, rank 1 the hand-written loop; a barrier passes the turn, so one runs at a time."""
    init_gloo()
    torch.set_num_threads(1)  # the machine's other core belongs to whoever else runs
    optim_cfg = OmegaConf.structured(OptimSchema)  # the run config's optimizer defaults
    step = (SluiceStep if rank == 0 else PlainStep)(setup, optim_cfg)
    micro = batches(setup, dense_model(setup).config.vocab_size)
    first_loss = step(micro)  # same weights, same data: the same first loss in both
    times = take_turns(lambda: step(micro), rank, world, setup.warmup, setup.rounds)
    return {"times": times, "first_loss": first_loss, "clip_cpu_s": clip_costs(step) if rank == 0 else None}


def main(argv: list[str]) -> dict:
    parser = bench_parser(__doc__, "tiny model, 1 round: checks the script works", rounds=8, warmup=2)
    args = parser.parse_args(argv)
    if args.smoke:
        setup = Setup(layers=2, hidden=64, seq=16, micro_batch_size=1, microbatches=2, warmup=1, rounds=1)
    else:
        setup = Setup(8, 256, 128, 1, 8, args.warmup, args.rounds)
    ours, plain = run_workers(worker, 2, setup, timeout=1800)
    sluice_t, plain_t = ours["times"].summary("sluice"), plain["times"].summary("plain")
    section = {"ratio": sluice_t["sluice_s"] / plain_t["plain_s"],
               "cpu_ratio": sluice_t["sluice_cpu_s"] / plain_t["plain_cpu_s"], **sluice_t, **plain_t,
               "first_loss": {"sluice": ours["first_loss"], "plain": plain["first_loss"]},
               "clip_cpu_s": ours["clip_cpu_s"], "setup": asdict(setup)}
    update_results("overhead", section, args.results)
    print(f"sluice {section['sluice_s']:.3f} s, plain {section['plain_s']:.3f} s, ratio {section['ratio']:.3f}, "
          f"CPU ratio {section['cpu_ratio']:.3f} (first loss {ours['first_loss']:.6f} vs {plain['first_loss']:.6f}); "
          f"grad-norm clipping CPU s: {section['clip_cpu_s']}")
    return section


if __name__ == "__main__":
    main(sys.argv[1:])
