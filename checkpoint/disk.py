"""A checkpoint disk that is full or read-only: one line naming the folder and the space a checkpoint needs.

The space needed is estimated from the state's bytes (every stored tensor once: a DP replica is written by one rank
only, a TP or EP shard by its own rank), known before anything is written; a save is refused up front when the disk
has less free, and a write that still fails (another process filled the disk, a read-only or quota-limited
folder) is named by its cause, with the same figures.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


# The causes a disk gives; anything else is reported by its own text.
CAUSES = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
          errno.EROFS: "the disk is read-only", errno.EACCES: "permission denied",
          errno.EPERM: "permission denied", errno.EFBIG: "a file grew beyond the file system's limit"}


def human(size: float) -> str:
    """`size` bytes as a short figure (1.5 MB, 30 GB)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def space_problem(directory: Path, needed: int, what: str) -> str | None:
    """One line when `directory` (existing) has less free space than `needed` bytes, else None."""
    free = shutil.disk_usage(directory).free
    if free >= needed:
        return None
    return (f"{what}: {directory} has {human(free)} free, the checkpoint needs about {human(needed)}; free space "
            "there or set checkpoint.dir to a larger disk")


def write_problem(error: BaseException, directory: Path, needed: int, what: str) -> str | None:
    """One line for a failed write whose cause is the disk (full, read-only, no permission), else None."""
    cause = disk_cause(error) or volume_cause(directory, needed)
    if cause is None:
        return None
    return (f"{what}: writing to {directory} failed: {cause}; the checkpoint needs about {human(needed)} there: free "
            "space, make it writable or set checkpoint.dir to another disk")


def disk_cause(error: BaseException | None, seen: int = 0) -> str | None:
    """The disk's cause inside `error` (an OSError, or one that DCP wrapped per rank), or None."""
    if error is None or seen > 8:
        return None
    if isinstance(error, OSError) and error.errno in CAUSES:
        return f"{CAUSES[error.errno]} ({errno.errorcode[error.errno]})"
    for _, (inner, _) in sorted(getattr(error, "failures", {}).items()):  # DCP's CheckpointException: per rank
        if cause := disk_cause(inner, seen + 1):
            return cause
    return disk_cause(error.__cause__ or error.__context__, seen + 1)


def volume_cause(directory: Path, needed: int) -> str | None:
    """The disk's state when a write failed without an errno, or None: torch's zip writer turns a short write on a
    full disk into 'RuntimeError: ... unexpected pos', so the folder's file system is asked (before the partial save
    is removed) whether it is read-only or has less free than the checkpoint needs."""
    try:
        volume = os.statvfs(directory)
    except OSError:
        return None
    if volume.f_flag & os.ST_RDONLY:
        return f"{CAUSES[errno.EROFS]} (EROFS)"
    if volume.f_bavail * volume.f_frsize < needed:
        return f"{CAUSES[errno.ENOSPC]} (ENOSPC)"
    return None
