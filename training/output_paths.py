"""Output locations checked before anything runs: a folder (or file) that exists as the wrong kind, cannot be
created or cannot be written is one line naming the setting, never a traceback after hours of training."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(folder: Path) -> bool:
    """`folder` accepts a new file: permissions and a probe (a read-only mount passes os.access as root)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def output_dir_problem(path: str | Path, key: str) -> str | None:
    """One line when the folder `path` (set by `key`) cannot be created or written; None when it can."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{key}={path} is a file, not a folder; choose another {key}"
    existing = _nearest_existing(path)
    if not existing.is_dir():
        return f"{key}={path} cannot be created: {existing} is a file; choose another {key}"
    if not _writable(existing):
        return f"{key}={path}: {existing} is not writable; choose a writable {key}"
    return None


def output_file_problem(path: str | Path, key: str) -> str | None:
    """One line when the file `path` (set by `key`) cannot be written; None when it can."""
    path = Path(path)
    if path.is_dir():
        return f"{key}={path} is a folder; give a file name"
    return output_dir_problem(path.parent, f"the folder of {key}")
