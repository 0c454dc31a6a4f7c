"""Sharded data parallelism (`parallel.zero=2/3`, FSDP2 `fully_shard` per decoder layer): per-rank memory of
parameters, gradients and AdamW state at dp2 and dp4 against plain data parallelism (zero=0) and ZeRO-1, and the step
time of zero=3 against the loop a PyTorch user writes with `fully_shard` on the same MiniMind. Writes the "fsdp"
section of results.json.

Memory is counted, not sampled: in `dp` workers each variant (the engine and optimizer the Trainer builds) runs two
steps, and this rank's bytes are summed tensor by tensor, a shard by its local part: parameters, the gradients as the
backward left them (after FSDP's reduce-scatter: this rank's shard) and the AdamW state ("held": what a rank keeps
from one step to the next). The ideal is zero=0's total / dp. "In step" is the same count at the step's fullest
moment: at zero=2 just before a stage's gradients are reduce-scattered (`parallel.fsdp.reduce_stage`, after its
last backward), when the weights are still gathered and the gradients of every micro-batch accumulated unsharded; at
zero=3 (reduced and resharded every micro-batch) at the same point, which leaves out the one layer whose weights and
gradient are whole inside each forward and backward; at zero 0/1 the held figure is the in-step one. Beside them at
dp2, each of dp, zero1, zero3 and the fully_shard loop (reducing every micro-batch) alone in two fresh processes:
the fullest rank's peak resident set over three steps above what it held before
building the model (activations and communication buffers included).

Step time: Sluice zero=3 against the fully_shard loop that reduce-scatters after every micro-batch, as zero=3 does
(FSDP's default), and zero=2 against the loop with `set_requires_gradient_sync` on the last micro-batch only, as
zero=2 reduces once a step: all four live in the same two processes and take turns, one step each per round (the
order turned every round) after a warm-up; the first losses must agree (rel 1e-5).

    python scripts/bench/fsdp.py [--smoke] [--rounds N] [--warmup N] [--results PATH]
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import freed_to_the_system, grad_bytes, held_bytes, init_gloo, peak_growth_mib, run_workers  # noqa: E402
from data_parallel import BUCKET_MB, DDPStep, SluiceDP, parsed_setup, replica_batches  # noqa: E402
from harness import first_then_alternate, paired, ratio_and_spread, update_results  # noqa: E402
from vs_torch import Setup  # noqa: E402

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import parallel.fsdp_sync  # noqa: E402
from parallel.fsdp import local  # noqa: E402
from parallel.grid import ParallelGrid  # noqa: E402
from training.config.schema import OptimSchema  # noqa: E402

DPS = (2, 4)  # the data-parallel sizes of the memory table
TIMING_DP = 2  # the step-time comparison's
ZERO = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}  # variant -> parallel.zero
RESIDENT = ("dp", "zero1", "zero3", "fully_shard")  # the variants whose peak resident set is measured at dp2
GOAL = 1.10  # zero=3's held bytes per rank at most this times the ideal 1/dp share
LOSS_RTOL = 1e-5


class FullyShardStep(DDPStep):
    """What a PyTorch user writes with FSDP2: `fully_shard` on each decoder layer, then on the model (the tied
    embedding and head in the root's group), the loss times dp (FSDP averages over the replicas, as DDP does),
    `clip_grad_norm_`, AdamW, `zero_grad`; gradients reduce-scattered after every micro-batch (FSDP's default) or,
    `no_sync`, with `set_requires_gradient_sync` on the last micro-batch only."""

    def __init__(self, setup: Setup, optim_cfg, no_sync: bool = True):
        self.no_sync = no_sync
        super().__init__(setup, optim_cfg, zero=0)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        for layer in model.model.layers.values():  # MiniMind keys its layers by index (a ModuleDict)
            fully_shard(layer)
        return fully_shard(model)

    def accumulating(self, last: bool):
        self.model.set_requires_gradient_sync(last or not self.no_sync)
        return nullcontext()


class Counted:
    """A Sluice variant's step with this rank's bytes recorded: the gradients the backward left (`on_grads`) and, at
    zero 2/3, everything held just before each stage's reduce-scatter (the step's fullest moment)."""

    def __init__(self, setup: Setup, optim_cfg, grid: ParallelGrid, zero: int):
        self.grads: dict[int, int] = {}
        self.in_step = 0
        self.step = SluiceDP(setup, optim_cfg, grid, zero, on_grads=self._record)
        self.params = self.step.params

    def _record(self, params: list) -> None:
        self.grads = grad_bytes(params)

    def held(self) -> dict:
        return held_bytes(self.params, self.grads, self.step.optimizer)

    def before_reduce(self, root: FSDPModule) -> None:
        modules = [m for stage in self.step.engine.sharded.values() for m in stage.root.modules()]
        self.in_step = max(self.in_step, held_now(self.params, self.step.optimizer, modules))

    def __call__(self, micro: list) -> float:
        return self.step(micro)


def held_now(params: list, optimizer, modules: list) -> int:
    """Every byte of parameters, gradients and optimizer state this rank holds now, each storage once: the weights
    FSDP keeps whole and their gradients, and of each sharded one its shard, its gathered copy while allocated and
    its unsharded gradient while accumulated."""
    tensors = [t for p in params if not isinstance(p, DTensor) for t in (p, p.grad)]
    state = getattr(optimizer, "optim", optimizer).state
    tensors += [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for module in modules:
        group = fully_shard.state(module)._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else ():
            unsharded = getattr(fp, "_unsharded_param", None)
            tensors += [fp._sharded_param_data, *getattr(fp, "all_gather_outputs", ()),
                        getattr(fp, "unsharded_accumulated_grad", None), unsharded,
                        unsharded.grad if unsharded is not None else None]
    storages = {}
    for t in tensors:
        if t is not None:
            storage = local(t).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(n for ptr, n in storages.items() if ptr)


def plain_in_step(setup: Setup, optim_cfg, micro: list) -> int:
    """The fully_shard loop's bytes (`held_now`) as its last micro-batch starts, over two steps: its weights resharded,
    the earlier micro-batches' gradients accumulated unsharded (its peak is a little above, in the last backward)."""
    plain, seen = FullyShardStep(setup, optim_cfg), [0]
    accumulating = plain.accumulating

    def counting(last: bool):
        if last:
            seen[0] = max(seen[0], held_now(list(plain.model.parameters()), plain.optimizer,
                                            list(plain.model.modules())))
        return accumulating(last)

    plain.accumulating = counting
    for _ in range(2):
        plain(micro)
    return seen[0]


def memory_worker(rank: int, world: int, setup: Setup) -> dict:
    """Each variant in turn in these `world` processes: two steps, then this rank's bytes (see the docstring)."""
    init_gloo()
    optim_cfg = OmegaConf.structured(OptimSchema)
    grid = ParallelGrid.build(dp=world, tp=1, pp=1, backend="gloo", timeout_s=600)
    micro = replica_batches(setup, rank, world)
    out, reduce = {}, parallel.fsdp_sync.reduce_stage
    for name, zero in ZERO.items():
        counted = Counted(setup, optim_cfg, grid, zero)

        def counting(root, counted=counted):
            counted.before_reduce(root)
            reduce(root)

        parallel.fsdp_sync.reduce_stage = counting
        try:
            for _ in range(2):
                counted(micro)
        finally:
            parallel.fsdp_sync.reduce_stage = reduce
        held = counted.held()
        out[name] = {**held, "in_step": max(counted.in_step, held["total"])}
        del counted
    out["fully_shard_in_step"] = plain_in_step(setup, optim_cfg, micro)
    return out


def resident_worker(rank: int, world: int, setup: Setup, name: str) -> dict:
    """One variant alone: its peak resident set over three steps above what the process held before."""
    init_gloo()
    optim_cfg = OmegaConf.structured(OptimSchema)
    grid = ParallelGrid.build(dp=world, tp=1, pp=1, backend="gloo", timeout_s=600)
    build = (lambda: FullyShardStep(setup, optim_cfg, no_sync=False)) if name == "fully_shard" else \
        (lambda: SluiceDP(setup, optim_cfg, grid, ZERO[name]))
    return {"peak_mib": peak_growth_mib(build, replica_batches(setup, rank, world))}


def timing_worker(rank: int, world: int, setup: Setup) -> dict:
    """zero=3 against the loop reducing every micro-batch as it does, zero=2 against the loop reducing once a step."""
    init_gloo()
    optim_cfg = OmegaConf.structured(OptimSchema)
    grid = ParallelGrid.build(dp=world, tp=1, pp=1, backend="gloo", timeout_s=600)
    steps = {"zero3": SluiceDP(setup, optim_cfg, grid, ZERO["zero3"]),
             "fully_shard": FullyShardStep(setup, optim_cfg, no_sync=False),
             "zero2": SluiceDP(setup, optim_cfg, grid, ZERO["zero2"]),
             "fully_shard_no_sync": FullyShardStep(setup, optim_cfg, no_sync=True)}
    return first_then_alternate(steps, replica_batches(setup, rank, world), setup.warmup, setup.rounds)


PAIRS = {"zero3": "fully_shard", "zero2": "fully_shard_no_sync"}  # Sluice's level -> the loop reducing as it does


def step_row(ours: dict, name: str) -> dict:
    """One step-time comparison: medians, per-round ratio, wins and the first losses."""
    peer = PAIRS[name]
    sluice, torch_ = ours["times"][name], ours["times"][peer]
    row = {**sluice.summary("sluice"), **torch_.summary("torch")}
    losses = {"sluice": ours["first_loss"][name], "torch": ours["first_loss"][peer]}
    return {"dp": TIMING_DP, "zero": ZERO[name], "peer": peer, "sluice_over_torch": row["sluice_s"] / row["torch_s"],
            **ratio_and_spread(sluice.wall, torch_.wall), **row, **paired(row), "first_loss": losses,
            "losses_equal": abs(losses["sluice"] - losses["torch"]) <= LOSS_RTOL * abs(losses["torch"])}


def memory_table(by_rank: list[dict], dp: int) -> dict:
    """Per variant: the fullest rank's bytes of each kind, and the held and in-step totals over the ideal share."""
    ideal = max(r["dp"]["total"] for r in by_rank) / dp
    rows = {}
    for name in ZERO:
        row = {k: max(r[name][k] for r in by_rank) for k in ("params", "grads", "optimizer", "total", "in_step")}
        rows[name] = {"zero": ZERO[name], **row, "over_ideal": row["total"] / ideal,
                      "in_step_over_ideal": row["in_step"] / ideal}
    plain = max(r["fully_shard_in_step"] for r in by_rank)
    return {"ideal": ideal, "rows": rows, "goal_met": rows["zero3"]["over_ideal"] <= GOAL,
            "fully_shard_in_step": plain, "fully_shard_in_step_over_ideal": plain / ideal}


def main(argv: list[str]) -> dict:
    args, setup = parsed_setup(__doc__, argv)
    memory = {f"dp{dp}": memory_table(run_workers(memory_worker, dp, setup, timeout=1800), dp) for dp in DPS}
    ours = run_workers(timing_worker, TIMING_DP, setup, timeout=1800)[0]
    with freed_to_the_system():
        resident = {name: max(r["peak_mib"] for r in run_workers(resident_worker, TIMING_DP, setup, name,
                                                                   timeout=1800)) for name in RESIDENT}
    steps = {name: step_row(ours, name) for name in PAIRS}
    section = {"memory": memory, "goal": GOAL, "steps": steps, "peak_growth_mib": resident, "peak_growth_dp": TIMING_DP,
               "bucket_mb": BUCKET_MB, "setup": asdict(setup)}
    update_results("fsdp", section, args.results)
    mib = 2**20
    for dp, table in memory.items():
        for name, v in table["rows"].items():
            print(f"{dp} {name}: held per rank {v['params'] / mib:.1f} params + {v['grads'] / mib:.1f} grads + "
                  f"{v['optimizer'] / mib:.1f} AdamW = {v['total'] / mib:.1f} MiB ({v['over_ideal']:.3f}x the ideal "
                  f"{table['ideal'] / mib:.1f}); in step {v['in_step'] / mib:.1f} MiB ({v['in_step_over_ideal']:.3f}x)")
        print(f"{dp} fully_shard loop before its last micro-batch: {table['fully_shard_in_step'] / mib:.1f} MiB "
              f"({table['fully_shard_in_step_over_ideal']:.3f}x)")
    print("dp2 peak resident growth: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in resident.items()))
    for name, step in steps.items():
        print(f"dp2 {name} vs {step['peer']}: sluice {step['sluice_s']:.3f} s, torch {step['torch_s']:.3f} s (ratio "
              f"{step['sluice_over_torch']:.3f}, per-round median {step['ratio']:.3f} ± {step['spread']:.3f}, Sluice "
              f"faster in {step['sluice_wins']} of {step['rounds']} rounds); first loss {step['first_loss']}")
    return section


if __name__ == "__main__":
    main(sys.argv[1:])
