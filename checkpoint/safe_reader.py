"""Reading a DCP checkpoint without running code from it: its `.metadata` pickle through an allow-list.

DCP writes `.metadata` with `pickle` and reads it back with `pickle.load`, so a crafted file runs whatever it
names on `checkpoint.resume=<path>`, `resume=auto` or an export. `SafeReader` unpickles it with a
`find_class` that admits only what DCP's metadata is made of (its metadata dataclasses, torch.Size, dtypes,
layouts, memory formats, paths) and refuses anything else in one line naming the file and the class. A key
stored as pickled bytes (BytesStorageMetadata) is refused too: DCP would `torch.load(weights_only=False)` it.
Tensor data (`*.distcp`) DCP already reads with `torch.load(weights_only=True)`; the files it names are checked to
sit inside the checkpoint folder as regular files (`confine.inside`) before DCP opens any: a storage path such as
`../step_5/__0_0.distcp` or `/elsewhere/__0_0.distcp` would load another checkpoint's weights, a FIFO would block.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from checkpoint.confine import inside
from checkpoint.dcp_checks import check_metadata
from checkpoint.dense import CheckpointError

METADATA_FILE = ".metadata"
# module -> names admitted from it (None: every class the module defines; checked against the module itself)
ALLOWED: dict[str, set[str] | None] = {
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # dtypes, layouts and memory formats are admitted by their type below
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}
TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the allow-listed names; anything else is refused, never imported."""

    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), TORCH_VALUE_TYPES):
            return getattr(torch, name)
        names = ALLOWED.get(module, set())
        if module == "torch.distributed.checkpoint.metadata" and names is None:
            value = getattr(dcp_metadata, name, None)
            if isinstance(value, type) and value.__module__ == module:
                return value
        elif names and name in names:
            return super().find_class(module, name)
        named = f"{module}.{name}".encode("unicode_escape").decode()  # a crafted name may hold a newline: one line
        raise CheckpointError(f"checkpoint {self.source} names {named}, which DCP checkpoint metadata never "
                              "holds; refusing to unpickle it (the file may be crafted to run code): use a "
                              "checkpoint from a source you trust")


def load_metadata(path: Path) -> Metadata:
    """The DCP metadata at `path` (a file), unpickled through the allow-list; refuses pickled-object keys."""
    try:
        with open(path, "rb") as file:
            metadata = RestrictedUnpickler(file, path).load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError, MemoryError, RecursionError) as error:  # a cut or flipped file: what the pickle VM says
        raise CheckpointError(f"checkpoint {path}: unreadable metadata ({type(error).__name__}); the checkpoint is "
                              "corrupt or truncated: resume from another one") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path} holds a {type(metadata).__name__}, not DCP metadata; the "
                              "checkpoint is corrupt or not a Sluice checkpoint")
    check_metadata(metadata, path)  # its values: sizes, chunks inside and covering each tensor, storage entries
    pickled = [key for key, value in metadata.state_dict_metadata.items() if isinstance(value, BytesStorageMetadata)]
    if pickled:
        raise CheckpointError(f"checkpoint {path}: {pickled[0]} is stored as a pickled object, which a Sluice "
                              "checkpoint never holds; refusing to unpickle it (it could run code)")
    return metadata


def check_storage(folder: Path, metadata: Metadata) -> None:
    """Every file the metadata names for tensor data is a regular file inside `folder` (stat only, none opened)."""
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not all(isinstance(info, _StorageInfo) and isinstance(info.relative_path, str)
                                                for info in storage.values()):
        raise CheckpointError(f"checkpoint {folder}: its {METADATA_FILE} does not name the files its tensors are "
                              "stored in; the checkpoint is corrupt: resume from another one")
    for name in sorted({info.relative_path for info in storage.values()}):
        inside(folder, name, "checkpoint")


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with the metadata read through `load_metadata` and its storage files confined."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        folder = Path(self.path)
        metadata = load_metadata(inside(folder, name, "checkpoint"))  # a FIFO is refused here, never opened
        check_storage(folder, metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
