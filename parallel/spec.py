"""Typed, frozen specs the parallel layer is built from; `training` makes them once from the run config."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """Everything a step engine needs beyond the grid and the model."""

    pipeline: PipelineSpec
    micro_batch_size: int
    seq_len: int
    dtype: torch.dtype = torch.float32
    timeout_s: float = 300.0
    emulate: bool = False  # one process plays every pipeline rank of its (dp, tp) coordinate
    bucket_mb: float = 25.0  # data-parallel gradient buckets (MiB), reduced as soon as they are final

    @property
    def pipeline_ranks_per_process(self) -> int:
        """Pipeline ranks one process runs: all of them under emulation, else one."""
        return self.pipeline.pp if self.emulate else 1
