"""Safetensors files read through the `safetensors` library: its checks of the header, then one key at a time.

The library refuses what a hand-written reader let through: offsets that overlap, leave gaps or run past the file,
a negative shape, an unknown dtype, a shape whose size disagrees with its bytes, a header over 100 MB. Reading
uses its `pread` backend: each tensor is read into memory of its own, as a `WeightSource` must return. The default
`mmap` backend returns views of one private mapping of the whole file instead: a parameter made from one would alias
the file, and a tied weight read under two names would be two Parameters over the same bytes. Memory is no reason
either way: tests/test_lean_loading.py peaks at the same 145 MiB (a 75 MiB stage of a 244 MiB file) with both, and
with the positioned reads written by hand before.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, deserialize, safe_open

from checkpoint.errors import CheckpointError

BACKEND = "pread"
# What the library (or torch, building a tensor of a dtype it lacks) raises for a file it cannot read.
UNREADABLE = (SafetensorError, OSError, ValueError, TypeError, RuntimeError)
MAX_HEADER = 100_000_000  # the library's own bound on a header's length


class SafetensorsFile:
    """One safetensors file opened through the library (its whole header checked), then read key by key."""

    def __init__(self, file: Path):
        self.file = Path(file)
        try:
            self._handle = safe_open(self.file, framework="pt", backend=BACKEND)  # a file descriptor, no mapping
            slices = {key: self._handle.get_slice(key) for key in self._handle.keys()}
            self.table = {key: (view.get_dtype(), tuple(view.get_shape())) for key, view in slices.items()}
        except UNREADABLE as error:
            raise _refusal(self.file, error) from None

    def read(self, key: str) -> torch.Tensor:
        """The tensor `key` in memory of its own (positioned reads of its bytes only)."""
        try:
            return self._handle.get_tensor(key)
        except UNREADABLE as error:
            raise _refusal(self.file, error, key) from None


def read_file(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `file`, each in memory of its own."""
    try:
        with safe_open(file, framework="pt", backend=BACKEND) as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except UNREADABLE as error:
        raise _refusal(file, error) from None


def _refusal(file: Path, error: Exception, key: str | None = None) -> CheckpointError:
    """One line: the file, the key at fault where one is, and the library's reason."""
    reason = (str(error).splitlines() or [type(error).__name__])[0]
    for prefix in ("Error while deserializing header: ", "Error while deserializing: "):
        reason = reason.removeprefix(prefix)
    reason = reason.split(", expected one of")[0][:160]  # the library lists every dtype it knows
    key = key or _culprit(file)
    shown = key if key is None or key.isprintable() else repr(key)  # a newline in a key must not break the line
    at = f" (key {shown})" if key and f"`{key}`" not in reason else ""
    return CheckpointError(f"checkpoint.load_dense={file} is not a valid safetensors file{at}: {reason}; write it "
                           "again (save_file, save_pretrained) or download it again")


def _culprit(file: Path) -> str | None:
    """The first key whose entry the library rejects, to name it: its messages for a bad dtype or shape give only a
    column. Naming only (the library already refused the file): the entry's dtype is judged by the library itself on
    a zero-byte copy, its shape must be a list of counts."""
    try:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length)) if length <= MAX_HEADER else None
    except (OSError, ValueError, RecursionError, struct.error):
        return None
    if not isinstance(header, dict):
        return None
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                  for n in shape):
            return key
        probe = json.dumps({key: {"dtype": entry.get("dtype"), "shape": [0], "data_offsets": [0, 0]}}).encode()
        try:
            deserialize(struct.pack("<Q", len(probe)) + probe)
        except SafetensorError:
            return key
    return None
