"""A folder as a trust boundary: every file a checkpoint, weights folder or data source names stays inside it.

A name read from a file (a DCP storage path, a safetensors index's shard, a tokenizer file to copy) is data
written by whoever made the folder. It may be absolute, climb out with `..`, be a symlink to `/etc/...`, or be a
FIFO that blocks the first `open` forever. Each check here runs on the path alone (`os.stat`, no `open`), so a
refused file is never read and a FIFO never blocks.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePath

from checkpoint.errors import CheckpointError

KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
         stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


def regular_file(path: str | os.PathLike, what: str, error: type[Exception] = CheckpointError) -> Path:
    """`path` when it is a regular file (after symlinks); a FIFO, device, socket or folder is refused unopened."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as problem:
        raise error(f"{what}: {path} cannot be read ({problem.strerror or type(problem).__name__})") from None
    if not stat.S_ISREG(mode):
        kind = KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise error(f"{what}: {path} is {kind}, not a regular file; refusing to open it (replace it with the "
                    "real file)")
    return path


def inside(folder: str | os.PathLike, name: str | os.PathLike, what: str,
           error: type[Exception] = CheckpointError, must_exist: bool = True) -> Path:
    """`folder / name`, refused unless `name` is relative, has no `..`, resolves (symlinks followed) inside `folder`
    and, when `must_exist`, is a regular file."""
    if "\0" in str(name):  # os.stat would raise ValueError on it: a name no file has
        raise error(f"{what}: {folder} names {str(name)!r}, which holds a NUL byte no file name can; the folder is "
                    "corrupt or crafted: use one from a source you trust")
    folder, pure = Path(folder), PurePath(name)
    if pure.is_absolute() or ".." in pure.parts or str(name) == "":
        raise error(f"{what}: {folder} names {str(name)!r}, a path outside that folder; a folder's files must sit "
                    "inside it (the folder may be crafted: use one from a source you trust)")
    path = folder / pure
    real, root = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, root]) != root:
        raise error(f"{what}: {path} leads outside {folder} (to {real}); a folder's files must sit inside it "
                    "(replace the link with the file itself)")
    if must_exist:
        regular_file(path, what, error)
    return path


def files_inside(folder: str | os.PathLike, names: tuple[str, ...] | list[str], what: str,
                 error: type[Exception] = CheckpointError) -> list[Path]:
    """Those of `names` that exist in `folder` as regular files inside it, in order; one that leaves the folder or
    is not a regular file is refused (never copied or opened)."""
    folder = Path(folder)
    return [inside(folder, name, what, error) for name in names if os.path.lexists(folder / name)]


def read_small(path: str | os.PathLike, what: str, limit: int, error: type[Exception] = CheckpointError) -> str:
    """The text of a small file (a run's id, a folder's OWNER): a regular file checked by `stat` before it is opened
    (a FIFO never blocks, a link to /dev/zero is refused) and read to at most `limit` bytes (a larger one refused)."""
    path = regular_file(path, what, error)
    try:
        with open(path, "rb") as file:
            data = file.read(limit + 1)
    except OSError as problem:
        raise error(f"{what}: {path} cannot be read ({problem.strerror or type(problem).__name__})") from None
    if len(data) > limit:
        raise error(f"{what}: {path} is larger than {limit} bytes, more than such a file ever holds; it is not "
                    "the file it should be: delete or replace it")
    return data.decode("utf-8", errors="replace")
