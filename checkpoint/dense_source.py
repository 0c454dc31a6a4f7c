"""Dense checkpoints read lazily, one global key at a time, as a `WeightSource` for meta-built stages.

Each rank asks only for its own parameters: safetensors reads just those keys (`safe_open`), a `.pth` is
memory-mapped (`torch.load(mmap=True)`) so untouched tensors never enter memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from checkpoint.dense import EMBEDDING, TIED_HEAD, CheckpointError, check_keys
from parallel.materialize import WeightSource

Reader = Callable[[str], torch.Tensor]


def dense_source(path: str | Path, expected: dict[str, tuple[int, ...]]) -> WeightSource:
    """A source over the checkpoint at `path`, checked up front against the model's keys (strict, one line)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint.load_dense={path} does not exist; pass an HF folder, a .safetensors "
                              "or a MiniMind .pth file")
    keys, read = _open(path)
    found = set(keys) | ({TIED_HEAD} if EMBEDDING in keys and TIED_HEAD in expected else set())
    check_keys(set(expected), found, str(path))

    def source(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = read(EMBEDDING if name == TIED_HEAD and TIED_HEAD not in keys else name)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"checkpoint.load_dense={path}: {name} has shape {tuple(tensor.shape)}, the "
                                  f"model expects {tuple(shape)}; check that the model preset matches the checkpoint")
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"checkpoint.load_dense={path}: {name} contains NaN or Inf; refusing to train "
                                  "from it (pick an earlier checkpoint)")
        return tensor

    return source


def _open(path: Path) -> tuple[list[str], Reader]:
    """The checkpoint's keys and a reader of one key, without loading the rest."""
    if path.is_dir():
        return _open_folder(path)
    if path.suffix == ".safetensors":
        return _open_safetensors({None: path})
    return _open_torch(path)


def _open_folder(folder: Path) -> tuple[list[str], Reader]:
    if (folder / "model.safetensors").exists():
        return _open_safetensors({None: folder / "model.safetensors"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return _open_safetensors({k: folder / f for k, f in weight_map.items()})
    if (folder / "pytorch_model.bin").exists():
        return _open_torch(folder / "pytorch_model.bin")
    raise CheckpointError(f"checkpoint.load_dense={folder}: no model.safetensors, model.safetensors.index.json "
                          "or pytorch_model.bin in that folder")


def _open_safetensors(files: dict[str | None, Path]) -> tuple[list[str], Reader]:
    """One file for every key (key None), or a key -> shard file map."""
    handles = {}

    def handle(file: Path):
        if file not in handles:
            try:
                handles[file] = safe_open(str(file), framework="pt")
            except Exception as error:  # safetensors raises its own types for truncated or foreign files
                raise CheckpointError(f"checkpoint.load_dense={file} is not a readable safetensors file: "
                                      f"{str(error).splitlines()[0]}") from None
        return handles[file]

    if None in files:
        keys = list(handle(files[None]).keys())
        return keys, lambda name: handle(files[None]).get_tensor(name)
    return list(files), lambda name: handle(files[name]).get_tensor(name)


def _open_torch(path: Path) -> tuple[list[str], Reader]:
    """A MiniMind .pth (or pytorch_model.bin), memory-mapped; a wrapping {"model": ...} is unwrapped."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise CheckpointError(f"checkpoint.load_dense={path} cannot be read as a state_dict: "
                              f"{str(error).splitlines()[0]}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint.load_dense={path} is not a state_dict of tensors")
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}  # torch.compile's prefix
    return list(state), state.__getitem__
