"""Checksums of a training checkpoint's files: a flipped byte is named on load, never trained on or exported.

A save records the sha256 of every shard (`*.distcp`) and of `meta.json` in `SHA256SUMS`, written before the
COMPLETE marker in the format of `sha256sum` (so `sha256sum -c SHA256SUMS` inside the folder checks it by hand).
The ranks share the hashing of a folder (rank r takes every world-th file), on save and on load, where the sums
are checked before DCP reads its metadata. DCP's `.metadata` has checks of its own (the unpickling allow-list,
its values' validation), which name a crafted one as such; a checksum would only call it corrupt. A checkpoint
saved before checksums were recorded has no SHA256SUMS and loads unverified.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from checkpoint.confine import inside
from checkpoint.dense import CheckpointError

SUMS = "SHA256SUMS"
SHARDS = "*.distcp"  # DCP's tensor files; meta.json joins them when the folder completes


def digest(path: Path) -> str:
    """The sha256 of the file at `path`, in hex."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def dcp_files(folder: Path) -> list[str]:
    """The names of the shards in `folder`, sorted (every rank lists the same)."""
    return sorted(p.name for p in Path(folder).glob(SHARDS))


def digests(folder: Path, names: Iterable[str]) -> dict[str, str]:
    """name -> sha256 of those `names` in `folder`."""
    return {name: digest(Path(folder) / name) for name in names}


def sums_text(sums: dict[str, str]) -> str:
    """The text of SHA256SUMS for `sums` (name -> hex), sorted by name."""
    return "".join(f"{value}  {name}\n" for name, value in sorted(sums.items()))


def read_sums(folder: Path) -> dict[str, str] | None:
    """name -> sha256 recorded in `folder`, or None for a checkpoint saved without checksums."""
    if not (Path(folder) / SUMS).exists():
        return None
    path = inside(folder, SUMS, f"checkpoint {folder}")  # a FIFO would block the read; a link may leave the folder
    sums: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        value, _, name = line.partition("  ")
        if len(value) != 64 or not name or any(c not in "0123456789abcdef" for c in value):
            raise CheckpointError(f"checkpoint {folder}: {SUMS} line {number} is not '<sha256>  <file>'; the "
                                  "checkpoint is corrupt: resume from another checkpoint")
        sums[name] = value
    return sums


def mismatch(folder: Path, sums: dict[str, str], names: Iterable[str]) -> str | None:
    """One line naming the first of `names` whose bytes differ from `sums` (or that is missing), else None."""
    for name in names:
        path = inside(folder, name, f"checkpoint {folder}: {SUMS}")  # a recorded name stays inside the folder
        if digest(path) != sums[name]:
            return (f"checkpoint {folder}: {name} is corrupt or truncated: it fails its checksum (its sha256 "
                    f"differs from the one {SUMS} recorded at save); resume from another checkpoint")
    return None


def checksum_problem(folder: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """This rank's share (rank, world) of `folder`'s recorded files checked against SHA256SUMS: one line, or None
    (also for a checkpoint saved without checksums)."""
    sums = read_sums(folder)  # raises, in one line, for a SUMS that is not a regular file or not checksums
    if sums is None:
        return None
    missing = [name for name in dcp_files(folder) if name not in sums]
    if missing:
        return (f"checkpoint {folder}: {missing[0]} has no checksum in {SUMS}: the file was added after the save; "
                "resume from another checkpoint")
    rank, world = share
    try:
        return mismatch(folder, sums, sorted(sums)[rank::world])
    except CheckpointError as error:  # a recorded name outside the folder, or not a regular file
        return str(error)
    except OSError as error:
        return f"checkpoint {folder}: reading it failed ({error.strerror or type(error).__name__})"


def check(folder: Path) -> None:
    """Raise CheckpointError when any file of `folder` fails its checksum (one process reads them all)."""
    if problem := checksum_problem(folder):
        raise CheckpointError(problem)
