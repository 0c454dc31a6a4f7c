"""Writes confined to their folder: a file is written under a temporary name inside it and renamed into place.

The write side of the trust boundary (confine.py is the read side). A name in an output folder may already be a
symlink (planted, or left by an earlier tool) to a file elsewhere: `open(path, "w")`, `shutil.copy` and
`torch.save(path)` write through it and overwrite the victim. Here a file is made under a fresh temporary name in the
target's own folder, exclusively and without following links (`O_EXCL | O_NOFOLLOW`), filled, flushed and renamed
over the target: `rename` replaces a link itself, never its target, and a reader sees the old file or the new one,
never half of one. A target that is a link or not a regular file is refused in one line. Appended files (logs,
metrics) are opened without following a link and checked to be regular before the first byte. A folder is replaced
as a whole the same way: built as a new sibling, then renamed into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeVar

from checkpoint.confine import KINDS
from checkpoint.errors import CheckpointError

T = TypeVar("T")
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # absent on Windows: there the lstat check below is all there is
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
MODE = 0o644  # what open() would give under the usual umask; a temporary file starts private (0o600)


def target_problem(path: Path, what: str) -> str | None:
    """One line when `path` exists as something a write must not replace (a link, a folder, a device), else None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return (f"{what}: {path} is a symbolic link; refusing to write through it (it may point at a file "
                "elsewhere): remove the link or choose another output")
    if not stat.S_ISREG(mode):
        return f"{what}: {path} is {KINDS.get(stat.S_IFMT(mode), 'not a regular file')}; choose another output"
    return None


def folder_problem(folder: Path, what: str) -> str | None:
    """One line when `folder` is a link or not a folder (a write inside would land elsewhere), else None."""
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return f"{what}: {folder} does not exist"
    if stat.S_ISLNK(mode):
        return (f"{what}: {folder} is a symbolic link; refusing to write through it (it may lead out of the "
                "intended folder): give the real folder")
    if not stat.S_ISDIR(mode):
        return f"{what}: {folder} is not a folder"
    return None


def output_folder(folder: Path, what: str, error: type[Exception] = CheckpointError) -> None:
    """`folder` made if missing; refused when it is a link (a file written inside would land elsewhere)."""
    if os.path.lexists(folder) and (problem := folder_problem(Path(folder), what)):
        raise error(problem)
    Path(folder).mkdir(parents=True, exist_ok=True)


@contextmanager
def confined_file(path: str | os.PathLike, what: str, error: type[Exception] = CheckpointError,
                  mode: int = MODE) -> Iterator[Path]:
    """A fresh temporary path beside `path` (created exclusively, never through a link) to write the file to; on
    success it is flushed and renamed over `path`, on failure removed. For writers that take a path (safetensors)."""
    path = Path(path)
    if problem := target_problem(path, what):
        raise error(problem)
    folder = path.parent
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)  # O_EXCL, no link followed
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _sync(tmp)
        os.chmod(tmp, mode)
        if problem := target_problem(path, what):  # a link planted while the file was written
            raise error(problem)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_with(path: str | os.PathLike, fill: Callable[[IO[bytes]], T], what: str,
               error: type[Exception] = CheckpointError) -> T:
    """Write `path` atomically: `fill` writes the content into an open binary file under a temporary name."""
    with confined_file(path, what, error) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | NOFOLLOW | CLOEXEC)
        with os.fdopen(fd, "wb") as file:
            return fill(file)


def write_bytes(path: str | os.PathLike, data: bytes, what: str, error: type[Exception] = CheckpointError) -> None:
    """`path` holds `data`, written under a temporary name and renamed into place."""
    write_with(path, lambda file: file.write(data), what, error)


def write_text(path: str | os.PathLike, text: str, what: str, error: type[Exception] = CheckpointError) -> None:
    """`path` holds `text` (UTF-8), written under a temporary name and renamed into place."""
    write_bytes(path, text.encode("utf-8"), what, error)


def copy_file(source: str | os.PathLike, path: str | os.PathLike, what: str,
              error: type[Exception] = CheckpointError) -> None:
    """Copy `source` (already checked by the reader: a regular file inside its folder) to `path`, confined."""
    with open(source, "rb") as src:
        write_with(path, lambda file: shutil.copyfileobj(src, file), what, error)


def save_torch(obj: object, path: str | os.PathLike, what: str, error: type[Exception] = CheckpointError) -> None:
    """`torch.save(obj)` into `path`, confined (torch.save given a path opens it through any link)."""
    import torch

    write_with(path, lambda file: torch.save(obj, file), what, error)


def open_append(path: str | os.PathLike, what: str, error: type[Exception] = CheckpointError) -> IO[str]:
    """`path` opened for appending text (created if missing), never through a link, refused unless a regular file:
    for logs whose every line must land even if the process is killed between two (a rename per line would not)."""
    path = Path(path)
    if problem := target_problem(path, what):  # stat only: a FIFO is never opened (that would block)
        raise error(problem)
    try:  # O_NONBLOCK: a FIFO swapped in after the check fails (ENXIO) instead of blocking
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | CLOEXEC | os.O_NONBLOCK, MODE)
    except OSError as problem:
        raise error(f"{what}: cannot write {path} ({problem.strerror or type(problem).__name__}); remove it or "
                    "choose another folder") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{what}: {path} is not a regular file; remove it or choose another folder")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


def replace_folder(out: str | os.PathLike, build: Callable[[Path], T], what: str,
                   error: type[Exception] = CheckpointError) -> T:
    """Build a folder with `build(new)` in a new sibling of `out`, then rename it to `out`, replacing an existing
    `out` as a whole (never editing its files in place); a failed build leaves `out` as it was and nothing else."""
    out = Path(out)
    if os.path.lexists(out) and (problem := folder_problem(out, what)):
        raise error(problem)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".new", dir=out.parent))
    try:
        result = build(new)
        os.chmod(new, 0o755)  # mkdtemp makes it private; an export is read by others as any folder is
        if os.path.lexists(out):
            if problem := folder_problem(out, what):  # a link planted while it was built
                raise error(problem)
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)  # out moved aside in one rename; removed once the new one is in place
            try:
                os.replace(new, out)
            except OSError:
                os.replace(old / out.name, out)  # put the old folder back: a failed export changes nothing
                os.rmdir(old)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(new, out)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    return result


def _sync(path: Path) -> None:
    """Flush `path`'s bytes to the disk before the rename makes them visible (a crash leaves old or new)."""
    fd = os.open(path, os.O_RDONLY | NOFOLLOW | CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
