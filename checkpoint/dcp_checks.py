"""The values of a DCP checkpoint's metadata, checked once it is unpickled (`safe_reader`) and before DCP plans a read.

The allow-list decides which classes the `.metadata` pickle may build; this decides whether their values make a
checkpoint: every tensor's size is a list of counts, its chunks lie inside it, overlap nowhere and cover it, and
every chunk has a storage entry (a file name, a non-negative offset and a length that holds at least the chunk's
bytes). DCP itself trusts these numbers: a chunk outside its tensor or two chunks over one region would be copied
into whatever DCP's load planner allocated, and a size of 10^12 elements would be allocated by the export.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)

from checkpoint.errors import CheckpointError


def _counts(value: Any, rank: int | None = None) -> bool:
    """A sequence of non-negative integers (of length `rank` when given): a shape, an offset or a size."""
    return isinstance(value, (tuple, list)) and (rank is None or len(value) == rank) and \
        all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_metadata(metadata: Metadata, path: Path) -> None:
    """Raise one CheckpointError naming `path` and the first key whose metadata cannot describe a checkpoint."""
    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {what}; the checkpoint is corrupt or was crafted: resume from "
                               "another one")

    try:
        _check_tables(metadata, refuse)
    except AttributeError as error:  # a flipped byte renamed a field of one of the pickled dataclasses
        raise refuse(f"its metadata lacks the field {error.name!r}") from None


def _check_tables(metadata: Metadata, refuse: Callable[[str], CheckpointError]) -> None:
    """check_metadata's checks of the key -> tensor and chunk -> file tables."""
    tensors, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(tensors, dict) or not isinstance(storage, dict):
        raise refuse("its metadata holds no key -> tensor and chunk -> file tables")
    for index, info in storage.items():
        if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str) and isinstance(info, _StorageInfo)
                and isinstance(info.relative_path, str) and _count(info.offset) and _count(info.length)):
            raise refuse(f"the storage entry of {getattr(index, 'fqn', index)!r} is not a file name with a "
                         "non-negative offset and length")
    for key, value in tensors.items():
        if not isinstance(key, str):
            raise refuse(f"a key is a {type(key).__name__}, not a name")
        if isinstance(value, BytesStorageMetadata):
            continue  # refused by load_metadata: never unpickled
        if problem := _tensor_problem(key, value, storage):
            raise refuse(f"{key} {problem}")


def _tensor_problem(key: str, value: Any, storage: dict) -> str | None:
    """What is wrong with one tensor's metadata, or None."""
    if not isinstance(value, TensorStorageMetadata) or not isinstance(value.properties, TensorProperties) \
            or not isinstance(value.properties.dtype, torch.dtype):
        return "is not described as a tensor with a dtype"
    size, chunks = value.size, value.chunks
    if not _counts(size):
        return f"has size {list(size) if isinstance(size, (tuple, list)) else size!r}, not a list of counts"
    if not isinstance(chunks, list) or not all(isinstance(c, ChunkStorageMetadata) and _counts(c.offsets, len(size))
                                               and _counts(c.sizes, len(size)) for c in chunks):
        return f"has chunks that are not offsets and sizes of its {len(size)} dimensions"
    for chunk in chunks:
        if any(o + n > dim for o, n, dim in zip(chunk.offsets, chunk.sizes, size)):
            return f"has a chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} outside its size {list(size)}"
        entry = storage.get(MetadataIndex(key, torch.Size(chunk.offsets)))
        if entry is None:
            return f"has a chunk at {list(chunk.offsets)} that no storage entry holds"
        if entry.length < math.prod(chunk.sizes) * value.properties.dtype.itemsize:
            return (f"has a chunk at {list(chunk.offsets)} of {math.prod(chunk.sizes)} elements stored in "
                    f"{entry.length} bytes")
    if (overlap := _overlap(chunks)) is not None:
        return f"has chunks at {list(overlap[0].offsets)} and {list(overlap[1].offsets)} that overlap"
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(size):
        return f"has chunks that do not cover its size {list(size)}"
    return None


def _overlap(chunks: list[ChunkStorageMetadata]) -> tuple[ChunkStorageMetadata, ChunkStorageMetadata] | None:
    """Two chunks sharing an element, or None: sorted along the first dimension, each is compared only with the
    chunks that start before it ends there."""
    boxes = sorted((c for c in chunks if math.prod(c.sizes) > 0), key=lambda c: tuple(c.offsets))
    for i, first in enumerate(boxes):
        for second in boxes[i + 1:]:
            if first.offsets and second.offsets[0] >= first.offsets[0] + first.sizes[0]:
                break
            if all(a < b + m and b < a + n for a, n, b, m in zip(first.offsets, first.sizes, second.offsets,
                                                                  second.sizes)):
                return first, second
    return None
