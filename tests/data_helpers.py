"""Shared helpers of the data tests: complete data sections from the schema, small configs, JSONL writers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from training.config.schema import DataSchema
from training.data import DataSpec, StepBatches, data_spec
SMALL = {"name": "synthetic", "num_docs": 300, "seed": 0, "vocab_size": 512}


def data_section(**overrides: Any) -> dict[str, Any]:
    """A complete `data` section: the schema's defaults (the synthetic preset's name) with `overrides`."""
    return {**dataclasses.asdict(DataSchema()), "name": "synthetic", **overrides}


def spec(**overrides: Any) -> DataSpec:
    """A DataSpec from the schema's defaults with `overrides`."""
    return data_spec(data_section(**overrides))


def make_cfg(data: dict, seq_len: int = 32, micro_batch_size: int = 2, n_microbatches: int = 2, seed: int = 0,
             dp: int | None = None):
    """A minimal run config with the fields the data package reads."""
    return OmegaConf.create({
        "data": data,
        "train": {"seq_len": seq_len, "micro_batch_size": micro_batch_size, "seed": seed},
        "schedule": {"n_microbatches": n_microbatches},
        "parallel": {"dp": dp},
    })


def write_jsonl(path: Path, texts: list[Any], key: str = "text") -> Path:
    """One {key: value} object per line."""
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts), encoding="utf-8")
    return path


def all_samples(stream: StepBatches) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample of a stream's set, in set order: (input_ids, labels)."""
    return stream.samples.take(torch.arange(len(stream.samples)))
