"""Activation recomputation against `torch.utils.checkpoint`: Sluice's `train.recompute=full` (each decoder layer
recomputed in its backward) and the loop a PyTorch user writes with every layer's forward wrapped in
`torch.utils.checkpoint` (non-reentrant), with Sluice's `selective` (attention core and gated activation only) and
no recomputation beside them; one process, the same MiniMind, micro-batches, clipping and AdamW settings. Writes
the "recompute" section of results.json.

Step time: every variant in the same process, one step each per round (A B C D, then D C B A) after a warm-up. Memory: each
variant alone in a fresh process, its peak resident set over three steps above what it held before the model was
built, with freed memory returned to the system at once (`common.freed_to_the_system`): activations kept for
backward are most of what differs.

    python scripts/bench/recompute.py [--smoke] [--rounds N] [--warmup N] [--results PATH]
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LoopStep, freed_to_the_system, peak_growth_mib, run_workers  # noqa: E402
from harness import bench_parser, first_then_alternate, update_results  # noqa: E402
from overhead import GRAD_CLIP, STEPS, PlainStep  # noqa: E402
from vs_torch import Setup, batches, dense_model  # noqa: E402

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from models import decoder_of  # noqa: E402
from parallel.engine import build_engine  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from parallel.spec import PipelineSpec  # noqa: E402
from training.config.schema import OptimSchema  # noqa: E402
from training.optim import build_optimizer  # noqa: E402
from training.specs import default_engine_spec  # noqa: E402

VARIANTS = ("sluice_full", "torch_checkpoint", "sluice_selective", "sluice_none", "torch_none")


class SluiceRecompute(LoopStep):
    """The Trainer's one-process step with `train.recompute=mode`."""

    def __init__(self, setup: Setup, optim_cfg, mode: str):
        grid = ParallelGrid.single("cpu")
        spec = default_engine_spec(PipelineSpec(n_microbatches=setup.microbatches), setup.micro_batch_size, setup.seq,
                                   recompute=mode)
        engine = build_engine(spec, decoder_of(dense_model(setup)), grid)
        super().__init__(engine, build_optimizer(engine.parameters(), optim_cfg), grid, optim_cfg, STEPS, GRAD_CLIP)


def checkpointed(setup: Setup, optim_cfg) -> PlainStep:
    """The hand-written loop with each decoder layer's forward under `torch.utils.checkpoint`."""
    step = PlainStep(setup, optim_cfg)
    for layer in step.model.model.layers.values():  # MiniMind keys its layers by id
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
    return step


def build(name: str, setup: Setup, optim_cfg):
    if name == "torch_checkpoint":
        return checkpointed(setup, optim_cfg)
    if name == "torch_none":
        return PlainStep(setup, optim_cfg)
    return SluiceRecompute(setup, optim_cfg, name.removeprefix("sluice_"))


def timing_worker(rank: int, world: int, setup: Setup) -> dict:
    torch.set_num_threads(2)  # one process: the machine's two cores
    optim_cfg = OmegaConf.structured(OptimSchema)
    micro = batches(setup, dense_model(setup).config.vocab_size)
    steps = {name: build(name, setup, optim_cfg) for name in VARIANTS}
    return first_then_alternate(steps, micro, setup.warmup, setup.rounds)


def memory_worker(rank: int, world: int, setup: Setup, name: str) -> dict:
    """One variant alone: its peak resident memory over three steps above what the process held before."""
    torch.set_num_threads(2)
    micro = batches(setup, dense_model(setup).config.vocab_size)
    return {"peak_mib": peak_growth_mib(lambda: build(name, setup, OmegaConf.structured(OptimSchema)), micro)}


def main(argv: list[str]) -> dict:
    parser = bench_parser(__doc__, "tiny model, 1 round: checks the script works", rounds=5, warmup=1)
    args = parser.parse_args(argv)
    if args.smoke:
        setup = Setup(layers=2, hidden=64, seq=16, micro_batch_size=1, microbatches=2, warmup=1, rounds=1)
    else:
        setup = Setup(8, 512, 512, 2, 2, args.warmup, args.rounds)
    ours = run_workers(timing_worker, 1, setup, timeout=1800)[0]
    with freed_to_the_system():
        memory = {name: run_workers(memory_worker, 1, setup, name, timeout=1800)[0]["peak_mib"] for name in VARIANTS}
    times = {name: ours["times"][name].summary(name) for name in VARIANTS}
    first = ours["first_loss"]
    section = {"rows": {name: {"step_s": times[name][f"{name}_s"], "runs_s": times[name][f"{name}_runs_s"],
                               "peak_mib": memory[name], "first_loss": first[name]} for name in VARIANTS},
               "full_over_checkpoint": times["sluice_full"]["sluice_full_s"] /
               times["torch_checkpoint"]["torch_checkpoint_s"],
               "memory_full_over_checkpoint": memory["sluice_full"] / memory["torch_checkpoint"],
               "losses_equal": all(abs(first[n] - first["torch_checkpoint"]) <= 1e-5 * abs(first["torch_checkpoint"])
                                   for n in VARIANTS), "setup": asdict(setup)}
    update_results("recompute", section, args.results)
    for name, row in section["rows"].items():
        print(f"{name}: step {row['step_s']:.3f} s, peak memory {row['peak_mib']:.1f} MiB, first loss "
              f"{row['first_loss']:.6f}")
    print(f"full / checkpoint: step {section['full_over_checkpoint']:.3f}, memory "
          f"{section['memory_full_over_checkpoint']:.3f}")
    return section


if __name__ == "__main__":
    main(sys.argv[1:])
