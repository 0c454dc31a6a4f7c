"""Typed, frozen specs the parallel layer is built from; `training` makes them once from the run config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from parallel.step import Objective


def resolve_dp(world_size: int, dp: int | None, tp: int, pp: int) -> int:
    """The data-parallel size of a world (`dp` or world // (tp*pp)); ValueError naming the keys to change.

    The one home of the world-size rule: the grid, the pre-launch check and the launcher all call it.
    `pp` is the pipeline ranks that are separate processes (1 under emulation)."""
    if dp is None:
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not a multiple of parallel.tp*pp = {tp}*{pp}; "
                             f"launch a multiple of {tp * pp} processes or change parallel.tp/pp")
        return world_size // (tp * pp)
    if dp * tp * pp != world_size:
        raise ValueError(f"world size {world_size} != parallel.dp*tp*pp = {dp}*{tp}*{pp}; "
                         f"launch {dp * tp * pp} processes or change the parallel sizes")
    return dp


@dataclass(frozen=True)
class ShardSpec:
    """What `parallel.zero` >= 2 asks: the level, and how many DP replicas hold each set of shards (HSDP)."""

    level: int  # 2: gradients and optimizer state sharded, parameters kept gathered from forward to the step's end
    replicate: int = 1  # parallel.dp_replicate: DP ranks (dp // replicate of them) shard within a replica
    param_dtype: torch.dtype = torch.float32  # parallel.mixed_precision_param: the gathered weights' (compute) dtype
    cpu_offload: bool = False  # parallel.cpu_offload: shards, their gradients and AdamW's state in CPU memory


@dataclass(frozen=True)
class PipelineSpec:
    """What the user asked of the pipeline: ranks, chunks per rank, schedule and micro-batches per step."""

    pp: int = 1
    vpp: int = 1
    schedule: str = "1f1b"
    n_microbatches: int = 1
    table_path: str | None = None  # the CSV/JSON file of `schedule=table`
    layers_per_stage: tuple[int, ...] | None = None  # None: balanced to one layer

    @property
    def n_stages(self) -> int:
        return self.pp * self.vpp


@dataclass(frozen=True)
class EngineSpec:
    """Everything a step engine needs beyond the grid and the model (no defaults: the run-config schema holds them;
    `training.specs.default_engine_spec` fills them in for benchmarks and tests)."""

    pipeline: PipelineSpec
    micro_batch_size: int
    seq_len: int
    dtype: torch.dtype
    timeout_s: float
    emulate: bool  # one process plays every pipeline rank of its (dp, tp) coordinate
    recompute: str  # activation recomputation of the decoder layers: none | full | selective
    compile: bool | str | None  # train.compile: true, false, auto or null (`parallel.compile.compile_mode` resolves it)
    bucket_mb: float  # data-parallel gradient buckets (MiB), reduced as soon as they are final
    transport: str  # pipeline P2P: auto (shared memory on one CPU host, else p2p) | shm | p2p
    passes: tuple[Callable, ...]  # the caller's own chunk passes (`parallel.passes`), run after TP and EP
    objective: Objective  # what the last stage computes from the logits (the trainer chooses it)
    shard: ShardSpec | None  # parallel.zero=2/3: FSDP over the DP ranks (`parallel.fsdp`); None: whole parameters
