"""The data config as a typed, frozen spec, the batch geometry the data serves, and the data error type."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

NAMES = ("synthetic", "jsonl")
FORMATS = ("packed", "padded", "chat", "chat_packed")  # chat: MiniMind conversations
PACKED_FORMATS = ("packed", "chat_packed")


class DataError(ValueError):
    """Bad data, data config or tokenizer; the message is one line naming the file (and line) and the fix."""


@dataclass(frozen=True)
class DataSpec:
    """The `data` config section; its defaults live only in the config schema (training/config/schema.py)."""

    name: str
    path: str | None
    tokenizer: str | None
    format: str
    num_docs: int
    seed: int
    shuffle: bool
    vocab_size: int
    cache_dir: str
    val_path: str | None
    val_fraction: float
    skip_bad_lines: bool
    max_line_bytes: int

    @property
    def chat(self) -> bool:
        """True when rows are MiniMind conversations rendered with the chat template."""
        return self.format.startswith("chat")

    @property
    def task(self) -> str:
        """The task whose columns each row must hold (a key of training.data.rows.TASKS)."""
        return "chat" if self.chat else "text"


@dataclass(frozen=True)
class Geometry:
    """What one step consumes: dp x n_microbatches x micro_batch_size sequences of seq_len tokens."""

    seq_len: int
    micro_batch_size: int
    n_microbatches: int
    seed: int  # shuffles the sample order (train.seed)

    def global_batch(self, dp: int) -> int:
        """Sequences in one global batch for `dp` replicas."""
        return dp * self.n_microbatches * self.micro_batch_size


def _field(node: Any, key: str, section: str) -> Any:
    """`node[key]` from a DictConfig or dict, or `node.key` from any object; missing -> DataError."""
    try:
        return node[key] if isinstance(node, Mapping) else getattr(node, key)
    except (KeyError, AttributeError):
        raise DataError(f"{section}.{key}: missing from the config; it belongs in the config schema") from None


def section(cfg: Any, key: str) -> Any:
    """A section (`data`, `train`, ...) of a run config given as a DictConfig, a dict or an object."""
    return _field(cfg, key, "cfg")


def optional_field(node: Any, key: str) -> Any:
    """`node.key`, or None when the node or the key is absent."""
    try:
        return None if node is None else _field(node, key, "cfg")
    except DataError:
        return None


def data_spec(node: Any) -> DataSpec:
    """A DataSpec from the `data` section (a DictConfig, a dict or an object); a DataSpec passes through."""
    if isinstance(node, DataSpec):
        return node
    return DataSpec(**{f.name: _field(node, f.name, "data") for f in fields(DataSpec)})


def geometry(cfg: Any) -> Geometry:
    """The batch geometry of a whole run config (train.* and schedule.n_microbatches)."""
    train, schedule = section(cfg, "train"), section(cfg, "schedule")
    return Geometry(
        seq_len=int(_field(train, "seq_len", "train")),
        micro_batch_size=int(_field(train, "micro_batch_size", "train")),
        n_microbatches=int(_field(schedule, "n_microbatches", "schedule")),
        seed=int(_field(train, "seed", "train")),
    )
