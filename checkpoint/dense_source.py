"""Dense checkpoints read lazily, one global key at a time, as a `WeightSource` for meta-built stages.

Each rank asks only for its own parameters: a safetensors file is read key by key at its offsets, a `.pth` is
memory-mapped (`torch.load(mmap=True)`) so untouched tensors never enter memory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from checkpoint.conversions import build, converted_keys
from checkpoint.confine import regular_file
from checkpoint.dense import INDEX, LOAD_DENSE, WEIGHTS, CheckpointError, check_keys, folder_weights, index_shards, \
    mapped_state_dict, read_index
from checkpoint.safetensors_file import SafetensorsFile
from parallel.materialize import WeightSource

Reader = Callable[[str], torch.Tensor]


def dense_source(path: str | Path, expected: dict[str, tuple[int, ...]], ties: dict[str, str],
                 model_type: str | None = None) -> WeightSource:
    """A source over the checkpoint at `path`, checked up front against the model's keys (strict, one line).

    A tied weight (`ties`: tied -> source) the file stores once is read from its source; a weight transformers
    stores in another layout (`model_type`'s declared conversions) is built from the stored keys it names."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint.load_dense={path} does not exist; pass an HF folder, a .safetensors "
                              "or a MiniMind .pth file")
    keys, read = _open(path)
    stored = set(keys)
    aliases = {tied: source for tied, source in ties.items() if tied not in stored and source in stored}
    converted = converted_keys(set(expected), stored, model_type)
    consumed = {k for _, groups in converted.values() for _, names in groups for k in names}
    check_keys(set(expected), (stored - consumed) | set(converted) | {t for t in aliases if t in expected}, str(path))

    def source(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = build(*converted[name], read) if name in converted else read(aliases.get(name, name))
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"checkpoint.load_dense={path}: {name} has shape {tuple(tensor.shape)}, the "
                                  f"model expects {tuple(shape)}; check that the model preset matches the checkpoint")
        if not tensor.is_floating_point():  # the model's parameters are floating point; any precision casts
            raise CheckpointError(f"checkpoint.load_dense={path}: {name} is stored as {tensor.dtype}, but the model's "
                                  "parameter is floating point; the file does not hold this model's weights")
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"checkpoint.load_dense={path}: {name} contains NaN or Inf; refusing to train "
                                  "from it (pick an earlier checkpoint)")
        return tensor

    return source


def _open(path: Path) -> tuple[list[str], Reader]:
    """The checkpoint's keys and a reader of one key, without loading the rest."""
    if path.is_dir():
        return _open_folder(path)
    regular_file(path, LOAD_DENSE)  # a FIFO would block the first read forever
    if path.suffix == ".safetensors":
        return _open_safetensors({None: path})
    return _open_torch(path)


def _open_folder(folder: Path) -> tuple[list[str], Reader]:
    """A save_pretrained folder; every file it names is a regular file inside it (`folder_weights`, `index_shards`)."""
    file = folder_weights(folder)
    if file.name == INDEX:
        return _open_safetensors(index_shards(folder, read_index(file)))
    return _open_safetensors({None: file}) if file.name == WEIGHTS else _open_torch(file)


def _open_safetensors(files: dict[str | None, Path]) -> tuple[list[str], Reader]:
    """One file for every key (key None), or a key -> shard file map (an index's, each key found in its shard).

    Every file's header is checked by the `safetensors` library before any tensor is read, and read through it
    key by key with positioned reads (`SafetensorsFile`: each tensor in memory of its own, no mapping)."""
    opened = {file: SafetensorsFile(file) for file in sorted(set(files.values()))}
    owner = {key: file for file, handle in opened.items() for key in handle.table} if None in files else files
    if (lost := next((key for key, file in owner.items() if key not in opened[file].table), None)) is not None:
        raise CheckpointError(f"checkpoint.load_dense={owner[lost]} has no {lost}, which the folder's index names "
                              "it for; the index does not match its shards: write the folder again (save_pretrained)")
    return list(owner), lambda name: opened[owner[name]].read(name)


def _open_torch(path: Path) -> tuple[list[str], Reader]:
    """A MiniMind .pth (or pytorch_model.bin), memory-mapped; a wrapping {"model": ...} is unwrapped."""
    state = mapped_state_dict(path)
    # A copy per read: a tied model's embedding and head share one storage in the file, and a Parameter must own
    # its memory (WeightSource's contract), not alias the mapped file or another Parameter.
    return list(state), lambda name: state[name].clone()
