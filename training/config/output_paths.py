"""Output locations checked before anything runs: a folder (or file) that exists as the wrong kind, cannot be
created or cannot be written is one line naming the setting, never a traceback after hours of training."""

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


def name_problem(path: Path, key: str) -> str | None:
    """One line when `path` is longer than the file system allows: a component over NAME_MAX (usually 255 bytes,
    asked of the deepest existing folder) or the whole over PATH_MAX (4096); checked before any stat, which raises."""
    size = len(os.fsencode(path.absolute()))
    if size >= 4096:
        return f"{key}: the path is {size} bytes, over the limit of 4096 (PATH_MAX); choose a shorter {key}"
    folder = Path(path.anchor) if path.is_absolute() else Path(".")
    for part in path.parts[1 if path.is_absolute() else 0:]:
        limit = os.pathconf(folder, "PC_NAME_MAX") if folder.is_dir() else 255
        if (size := len(os.fsencode(part))) > limit:
            return (f"{key}: the name {part[:20]}... is {size} bytes, over the file system's limit of {limit} per "
                    f"file or folder name; choose a shorter {key}")
        folder = folder / part
    return None


def output_dir_problem(path: str | Path, key: str) -> str | None:
    """One line when the folder `path` (set by `key`) cannot be created or written; None when it can."""
    path = Path(path)
    if problem := name_problem(path, key):
        return problem
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
