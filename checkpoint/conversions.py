"""transformers' declared on-disk layouts: a model key a checkpoint does not store, built from the keys it does.

transformers saves some weights in another layout than its modules hold them (Qwen3-MoE's stacked experts go to
disk as one `experts.<i>.gate_proj.weight` per expert) and declares the conversion per model type
(`transformers.conversion_mapping`). We apply the same declared operations, key by key, so that a rank reads only
the source tensors of the parameters it holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

Reader = Callable[[str], torch.Tensor]


def converters(model_type: str | None) -> list:
    """The weight converters transformers declares for `model_type` (renamings aside)."""
    declared = get_checkpoint_conversion_mapping(model_type) if model_type else None
    return [c for c in declared or () if getattr(c, "operations", None)]


def sources(key: str, stored: set[str], declared: list) -> tuple[object, list[tuple[str, list[str]]]] | None:
    """The converter that builds model key `key` and, per source pattern, the stored keys it reads (in index order),
    or None when no declared converter can build it from what is stored."""
    for converter in declared:
        target = converter.target_patterns[0]
        if not (key == target or key.endswith("." + target)):
            continue
        prefix = key[: len(key) - len(target)]
        groups = []
        for pattern in converter.source_patterns:
            regex = re.compile(re.escape(prefix + pattern).replace(r"\*", r"(\d+)"))
            found = sorted((int(m.group(1)), k) for k in stored if (m := regex.fullmatch(k)))
            if not found:
                break
            groups.append((pattern, [k for _, k in found]))
        else:
            return converter, groups
    return None


def build(converter, groups: list[tuple[str, list[str]]], read: Reader) -> torch.Tensor:
    """Read the source tensors and run the converter's declared operations on them, in order."""
    data: dict = {pattern: [read(k) for k in keys] for pattern, keys in groups}
    for operation in converter.operations:
        data = operation.convert(data, source_patterns=converter.source_patterns,
                                 target_patterns=converter.target_patterns)
    (tensor,) = data.values()
    return tensor


def converted_keys(expected: set[str], stored: set[str], model_type: str | None) -> dict[str, tuple]:
    """Model key -> (converter, source groups) for each expected key the checkpoint stores in another layout."""
    declared = converters(model_type)
    out = {}
    for key in sorted(expected - stored) if declared else ():
        found = sources(key, stored, declared)
        if found is not None:
            out[key] = found
    return out
