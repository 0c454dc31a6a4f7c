"""A model's size from its config's fields, in closed form, before any config object or module is built.

A config file sets the sizes a model allocates: `num_hidden_layers=1e9` makes a meta build loop a billion times (and
some transformers configs build a per-layer list in their constructor), `hidden_size=1e9` asks the allocator for
terabytes, `vocab_size=2**40` overflows an index. The count here is a sum over the model's distinct shapes (the
embedding, one decoder layer, the head) times how often each occurs, so it takes the same time for 2 layers or 2
billion; it reads only the fields, with the families' own defaults where a field is missing (a lower bound: a model
this count refuses cannot be built, one it accepts may still be checked by the memory model). Only the standard
library is imported: scripts/generate.py uses this module too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_DIM = 2**31 - 1  # torch's kernels index a dimension (an embedding row, a position) with int32
MAX_LAYERS = 10_000  # a meta build costs time per layer; the deepest published decoders have a few hundred
MAX_NUMEL = 2**63 - 1  # one tensor's element count is an int64
FP32 = 4
QK_NORM = {"minimind", "qwen3", "qwen3_moe", "gemma3", "gemma3_text"}  # a norm on each head's query and key


@dataclass(frozen=True)
class ModelSize:
    """Parameters of a config's model, the largest single weight's elements and its widest dimension (derived
    widths included: MiniMind's MLP width follows hidden_size)."""

    parameters: int
    largest: int
    widest: int

    def bytes(self, per_parameter: int = FP32) -> int:
        return self.parameters * per_parameter


def _int(data: dict[str, Any], *names: str, default: int = 1) -> int:
    """The first of `names` that `data` sets to a positive integer, else `default` (a missing field: the family's)."""
    for name in names:
        value = data.get(name)
        if type(value) is int and value > 0:
            return value
    return default


def model_size(data: dict[str, Any]) -> ModelSize:
    """The parameter count of the decoder `data` (a config.json's fields) describes, in closed form."""
    vocab, hidden = _int(data, "vocab_size"), _int(data, "hidden_size")
    layers, heads = _int(data, "num_hidden_layers"), _int(data, "num_attention_heads")
    kv_heads = _int(data, "num_key_value_heads", default=heads)
    head_dim = _int(data, "head_dim", default=max(1, hidden // heads))
    width = _int(data, "intermediate_size", default=math.ceil(hidden * math.pi / 64) * 64)
    experts = _int(data, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    model_type = data.get("model_type", "minimind")
    if model_type == "minimind" and not data.get("use_moe", False):
        experts = 0  # MiniMind reads its MoE fields only with use_moe
    expert_width = _int(data, "moe_intermediate_size", default=width)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    if isinstance(model_type, str) and model_type in QK_NORM:
        attention += 2 * head_dim
    mlp = 3 * hidden * width if experts == 0 else experts * (3 * hidden * expert_width + hidden)
    embedding = vocab * hidden
    head = 0 if data.get("tie_word_embeddings", True) else embedding
    return ModelSize(parameters=embedding + head + layers * (attention + mlp + 2 * hidden) + hidden,
                     largest=max(embedding, hidden * heads * head_dim, hidden * width, hidden * expert_width),
                     widest=max(vocab, hidden, width, expert_width, heads * head_dim))


def size_problem(data: dict[str, Any], where: str, memory: int | None = None,
                 per_parameter: int = FP32) -> str | None:
    """One line when the model `data` describes cannot be built: a dimension past what torch indexes, more layers
    than a build can walk, or (with `memory`, bytes the process may use) weights that do not fit; None when it can.
    `where` starts the line and names the file (e.g. "checkpoint X: meta.json's model")."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts", "num_local_experts"):
        value = data.get(name)
        if type(value) is int and value > MAX_DIM:
            return f"{where} {name}={value} is beyond what torch can index (at most {MAX_DIM}); fix {name}"
    layers = data.get("num_hidden_layers")
    if type(layers) is int and layers > MAX_LAYERS:
        return (f"{where} num_hidden_layers={layers} is more than {MAX_LAYERS} layers, beyond any model Sluice "
                "builds; fix num_hidden_layers")
    size = model_size(data)
    if size.widest > MAX_DIM:  # a width derived from the fields set (MiniMind's MLP width from hidden_size)
        return (f"{where} sizes make a dimension of {size.widest}, beyond what torch can index (at most {MAX_DIM}); "
                f"fix {_size_fields(data)}")
    if size.largest * 8 > MAX_NUMEL:  # its bytes, at up to 8 a value, are an int64 too
        return (f"{where} sizes make a weight of {size.largest} elements, beyond what torch can allocate; fix "
                f"{_size_fields(data)}")
    if memory is not None and size.bytes(per_parameter) > memory:
        gib = size.bytes(per_parameter) / 2**30
        return (f"{where} sizes make a model of {size.parameters / 1e9:.3g}B parameters ({gib:.1f} GiB of weights), "
                f"more than this host's {memory / 2**30:.1f} GiB of memory; fix {_size_fields(data)} or use a larger "
                "host")
    return None


def _size_fields(data: dict[str, Any]) -> str:
    """The fields the count grows with, as set (what a mistyped size is among)."""
    fields = [f"{name}={data[name]}" for name in ("num_hidden_layers", "hidden_size", "vocab_size",
                                                  "intermediate_size", "num_experts", "num_local_experts")
              if type(data.get(name)) is int]
    return ", ".join(fields) or "the model's sizes"


def host_memory() -> int:
    """This host's physical memory in bytes (what one process could ever hold)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**62  # unknown: no limit
