"""Data parallelism against `DistributedDataParallel`: Sluice at dp=2 (bucketed gradient sums started by
post-accumulate hooks, overlapping the backward) and the loop a PyTorch user writes with DDP (the same bucket size,
`no_sync` on all but the last micro-batch), on the same MiniMind, micro-batches, fp32, gloo, grad-norm clipping and
AdamW settings; and both again with the AdamW state sharded over the replicas: Sluice's `parallel.zero=1` against
DDP with `ZeroRedundancyOptimizer`. Writes the "data_parallel" section of results.json.

Step time: both variants live in the same two processes and take turns, one step each per round (A B, then B A) after a
warm-up. Memory: each variant alone in two fresh processes, the peak resident set (VmHWM) of its fullest rank over
its steps, less what the process held before the model was built (interpreter, torch, data), with freed memory
returned to the system at once (`common.freed_to_the_system`).

The size sweep (`scripts/bench/sizes.py`) calls `measure_cells`: both comparisons at each of a list of model sizes,
each in its own pair of processes, the cell's variants alternated as above; per cell the median of the per-round
ratios Sluice / peer and their spread (half the interquartile range of those ratios).

    python scripts/bench/data_parallel.py [--smoke] [--rounds N] [--warmup N] [--results PATH]
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LoopStep, freed_to_the_system, init_gloo, peak_growth_mib, run_workers  # noqa: E402
from harness import bench_parser, first_then_alternate, paired, ratio_and_spread, update_results  # noqa: E402
from overhead import GRAD_CLIP, STEPS  # noqa: E402
from vs_torch import Setup, batches, dense_model  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from models import decoder_of  # noqa: E402
from parallel.engine import build_engine  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from parallel.fsdp import LEVELS  # noqa: E402
from parallel.spec import PipelineSpec, ShardSpec  # noqa: E402
from parallel.step import MicroBatch  # noqa: E402
from training.config.schema import OptimSchema, schema_defaults  # noqa: E402
from training.objectives.lm import shifted_loss_sum  # noqa: E402
from training.optim import build_optimizer, lr_at  # noqa: E402
from training.specs import default_engine_spec  # noqa: E402

DP = 2
ZERO = {"dp": 0, "zero1": 1}  # comparison -> parallel.zero of both sides (1: ZeroRedundancyOptimizer on DDP's)
BUCKET_MB = schema_defaults()["parallel.bucket_mb"]  # Sluice's default, given to DDP as bucket_cap_mb too


class SluiceDP(LoopStep):
    """The Trainer's step at dp=2 (or the grid's dp): the engine's bucketed, overlapped gradient sums, clipping,
    AdamW; at `zero` 2 or 3 the layers sharded by FSDP instead (scripts/bench/fsdp.py)."""

    def __init__(self, setup: Setup, optim_cfg, grid: ParallelGrid, zero: int, on_grads=None):
        spec = default_engine_spec(PipelineSpec(n_microbatches=setup.microbatches), setup.micro_batch_size,
                                   setup.seq, bucket_mb=BUCKET_MB, shard=ShardSpec(zero) if zero in LEVELS else None)
        decoder, weights, values = meta_decoder(setup)
        engine = build_engine(spec, decoder, grid, weights)
        values.clear()  # the engine's parameters are copies: no dense model stays beside them
        optimizer = build_optimizer(engine.parameters(), optim_cfg, grid.dp_group, zero=zero)
        super().__init__(engine, optimizer, grid, optim_cfg, STEPS, GRAD_CLIP, on_grads)


def meta_decoder(setup: Setup) -> tuple:
    """The model as the Trainer hands it to the engine: on the meta device, each parameter filled from a source, here
    a copy of `dense_model`'s (the weights the torch side starts from). Given the materialised model instead, the
    engine's family adapter keeps it (for its modules, `_init_weights`), and with it a second copy of every weight
    the Trainer never holds (103 MiB at 8 x 512: the zero3 variant's peak resident set 548 against the fully_shard
    loop's 418 MiB). The source's values, to be cleared once the engine is built."""
    values = dense_model(setup).state_dict()
    with torch.device("meta"):
        meta = dense_model(setup)
    return decoder_of(meta), lambda name, shape: values[name].clone(), values


class DDPStep:
    """What a PyTorch user writes: DDP around the model, `no_sync` while accumulating, clip, AdamW, the step's
    loss summed over the replicas (as Sluice returns it)."""

    def __init__(self, setup: Setup, optim_cfg, zero: int):
        self.model, self.dp = self.wrap(dense_model(setup)), dist.get_world_size()
        options = dict(lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                       weight_decay=optim_cfg.weight_decay)
        self.optimizer = ZeroRedundancyOptimizer(self.model.parameters(), torch.optim.AdamW, **options) if zero \
            else torch.optim.AdamW(self.model.parameters(), **options)
        self.cfg, self.step_no = optim_cfg, 0

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)

    def accumulating(self, last: bool):
        """The context of one micro-batch's forward and backward: no gradient sum but on the last."""
        return self.model.no_sync() if not last else nullcontext()

    def __call__(self, micro: list[MicroBatch]) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step_no, STEPS, self.cfg)
        total = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            with self.accumulating(last):
                # DDP averages over the replicas: times dp, each gradient is the global token-mean's.
                loss = shifted_loss_sum(self.model(input_ids=mb.input_ids).logits, mb.labels) / mb.global_tokens
                (loss * self.dp).backward()
            total += loss.detach().double()
        dist.all_reduce(total)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_no += 1
        return float(total)


def replica_batches(setup: Setup, rank: int, dp: int = DP) -> list[MicroBatch]:
    """This replica's micro-batches, each carrying the label-token count of all `dp` replicas' (the global batch)."""
    vocab = dense_model(setup).config.vocab_size
    mine = [batches(setup, vocab) for _ in range(dp)]  # the same generator seed: shift each replica's ids apart
    every = [[MicroBatch((mb.input_ids + 97 * r) % vocab, (mb.labels + 97 * r) % vocab) for mb in mine[r]]
             for r in range(dp)]
    tokens = sum(mb.num_label_tokens() for replica in every for mb in replica)
    return [MicroBatch(mb.input_ids, mb.labels, tokens) for mb in every[rank]]


def timing_worker(rank: int, world: int, setup: Setup) -> dict:
    init_gloo()
    optim_cfg = OmegaConf.structured(OptimSchema)
    grid = ParallelGrid.build(dp=DP, tp=1, pp=1, backend="gloo", timeout_s=600)
    micro = replica_batches(setup, rank)
    steps = {}
    for name, zero in ZERO.items():
        steps[f"{name}_sluice"] = SluiceDP(setup, optim_cfg, grid, zero)
        steps[f"{name}_torch"] = DDPStep(setup, optim_cfg, zero)
    return first_then_alternate(steps, micro, setup.warmup, setup.rounds)


def cell_worker(rank: int, world: int, setup: Setup) -> dict:
    """One setup (cell): the four variants built and alternated (one step each per round, the order reversed every
    other round)."""
    init_gloo()
    optim_cfg = OmegaConf.structured(OptimSchema)
    grid = ParallelGrid.build(dp=DP, tp=1, pp=1, backend="gloo", timeout_s=600)
    steps = {}
    for name, zero in ZERO.items():
        steps[f"{name}_sluice"] = SluiceDP(setup, optim_cfg, grid, zero)
        steps[f"{name}_torch"] = DDPStep(setup, optim_cfg, zero)
    return first_then_alternate(steps, replica_batches(setup, rank), setup.warmup, setup.rounds)


def measure_cells(cells: list, warmup: int, rounds: int, timeout: float = 3600) -> dict[str, dict]:
    """dp2 against DDP and zero1 against DDP + ZeroRedundancyOptimizer at each cell (a `size_grid.Cell`): by cell
    name, by comparison, the ratio and spread (`ratio_and_spread`), the medians and the raw step times. Each cell in
    two fresh processes, as a user's run of one size is: after the cells before it in the same processes, dp2 at
    h256-l8 measured 1.06-1.11x DDP in each of three launches, alone in its own 0.96-1.03x."""
    setups = [Setup(c.layers, c.hidden, c.seq, c.micro_batch_size, c.microbatches, warmup, rounds) for c in cells]
    measured = [run_workers(cell_worker, DP, setup, timeout=timeout)[0] for setup in setups]
    out = {}
    for cell, ours in zip(cells, measured):
        rows = {}
        for name in ZERO:
            sluice, peer = ours["times"][f"{name}_sluice"], ours["times"][f"{name}_torch"]
            rows[name] = {**ratio_and_spread(sluice.wall, peer.wall), **sluice.summary("sluice"),
                          **peer.summary("torch"), "first_loss": {side: ours["first_loss"][f"{name}_{side}"]
                                                                  for side in ("sluice", "torch")}}
        out[cell.name] = rows
    return out


def memory_worker(rank: int, world: int, setup: Setup, name: str) -> dict:
    """One variant alone: its peak resident memory over its steps above what the process held before."""
    init_gloo()
    optim_cfg = OmegaConf.structured(OptimSchema)
    grid = ParallelGrid.build(dp=DP, tp=1, pp=1, backend="gloo", timeout_s=600)
    micro = replica_batches(setup, rank)
    kind, side = name.split("_")
    zero = ZERO[kind]
    build = (lambda: SluiceDP(setup, optim_cfg, grid, zero)) if side == "sluice" else \
        (lambda: DDPStep(setup, optim_cfg, zero))
    return {"peak_mib": peak_growth_mib(build, micro)}


def comparison(name: str, ours: dict, memory: dict) -> dict:
    """One row: Sluice against torch's on step time (medians, paired rounds), peak memory and the first loss."""
    row = {**ours["times"][f"{name}_sluice"].summary("sluice"), **ours["times"][f"{name}_torch"].summary("torch")}
    losses = {side: ours["first_loss"][f"{name}_{side}"] for side in ("sluice", "torch")}
    peak = {side: memory[f"{name}_{side}"] for side in ("sluice", "torch")}
    return {"zero": ZERO[name], "sluice_over_torch": row["sluice_s"] / row["torch_s"], **row, **paired(row),
            "peak_mib": peak, "memory_over_torch": peak["sluice"] / peak["torch"], "first_loss": losses,
            "losses_equal": abs(losses["sluice"] - losses["torch"]) <= 1e-5 * abs(losses["torch"])}


def parsed_setup(doc: str, argv: list[str]) -> tuple[argparse.Namespace, Setup]:
    """A data-parallel benchmark's options and model: MiniMind 8 x 512 at seq 128, or a tiny one with --smoke."""
    args = bench_parser(doc, "tiny model, 1 round: checks the script works", rounds=6, warmup=1).parse_args(argv)
    if args.smoke:
        return args, Setup(layers=2, hidden=64, seq=16, micro_batch_size=1, microbatches=2, warmup=1, rounds=1)
    return args, Setup(8, 512, 128, 2, 4, args.warmup, args.rounds)


def main(argv: list[str]) -> dict:
    args, setup = parsed_setup(__doc__, argv)
    ours = run_workers(timing_worker, DP, setup, timeout=1800)[0]
    with freed_to_the_system():
        memory = {f"{name}_{side}": max(r["peak_mib"] for r in run_workers(memory_worker, DP, setup,
                                                                            f"{name}_{side}", timeout=1800))
                  for name in ZERO for side in ("sluice", "torch")}
    section = {"dp": DP, "bucket_mb": BUCKET_MB, "rows": {name: comparison(name, ours, memory) for name in ZERO},
               "setup": asdict(setup)}
    update_results("data_parallel", section, args.results)
    for name, row in section["rows"].items():
        print(f"{name}: sluice {row['sluice_s']:.3f} s, torch {row['torch_s']:.3f} s (ratio "
              f"{row['sluice_over_torch']:.3f}, Sluice faster in {row['sluice_wins']} of {row['rounds']} rounds); peak "
              f"memory per rank {row['peak_mib']['sluice']:.1f} vs {row['peak_mib']['torch']:.1f} MiB (ratio "
              f"{row['memory_over_torch']:.3f}); first loss {row['first_loss']}")
    return section


if __name__ == "__main__":
    main(sys.argv[1:])
