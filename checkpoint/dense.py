"""Dense checkpoints (HF folder, .safetensors, MiniMind .pth): read the global-key state_dict, load it strictly."""

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint.confine import inside, regular_file
from checkpoint.errors import CheckpointError
from checkpoint.meta_schema import index_weight_map
from checkpoint.safetensors_file import SafetensorsFile, read_file
from parallel.decoder import DecoderPlan


def load_weights_only(path: Path, **kwargs) -> Any:
    """torch.load that admits tensors and plain containers only; anything else is refused in one line."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        lines = [line for line in str(error).splitlines() if "Unsupported" in line or "GLOBAL" in line]
        detail = lines[0].strip() if lines else str(error).splitlines()[0]
        raise CheckpointError(f"{path}: refusing to unpickle it ({detail}); a weights file holds tensors only: use "
                              "one from a source you trust") from None


def mapped_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A MiniMind .pth (or pytorch_model.bin) memory-mapped, a wrapping {"model": ...} unwrapped and torch.compile's
    `_orig_mod.` prefix dropped; one CheckpointError line unless it is a state_dict of tensors under string names."""
    try:
        state = load_weights_only(path, mmap=True)
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"checkpoint.load_dense={path} cannot be read as a state_dict: "
                              f"{str(error).splitlines()[0]}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"checkpoint.load_dense={path} is not a state_dict of tensors under string names")
    return {k.removeprefix("_orig_mod."): v for k, v in state.items()}


WEIGHTS, INDEX, TORCH_BIN = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
LOAD_DENSE = "checkpoint.load_dense"  # how a refused file of a weights folder or file is introduced


def folder_weights(folder: Path) -> Path:
    """The weights file of a transformers save_pretrained folder (single safetensors, a shard index or
    pytorch_model.bin), a regular file inside the folder (checked by stat, unopened)."""
    for name in (WEIGHTS, INDEX, TORCH_BIN):
        if os.path.lexists(folder / name):
            return inside(folder, name, LOAD_DENSE)
    raise CheckpointError(f"checkpoint.load_dense={folder}: no model.safetensors, model.safetensors.index.json "
                          "or pytorch_model.bin in that folder")


def index_shards(folder: Path, weight_map: dict[str, Any]) -> dict[str, Path]:
    """key -> the shard file a safetensors index names for it, each a regular file inside `folder` (not opened)."""
    if not all(isinstance(name, str) for name in weight_map.values()):
        raise CheckpointError(f"checkpoint.load_dense={folder / INDEX}: its weight_map must map each key to a shard "
                              "file name; the index is corrupt: write it again (save_pretrained)")
    shards = {name: inside(folder, name, LOAD_DENSE) for name in sorted(set(weight_map.values()))}
    return {key: shards[name] for key, name in weight_map.items()}


def read_index(file: Path) -> dict[str, str]:
    """The key -> shard file name map of a safetensors index (`model.safetensors.index.json`), checked against its
    schema (`meta_schema`)."""
    return index_weight_map(file)


def check_dense_files(path: str | Path) -> None:
    """Before launch: the files the dense checkpoint at `path` is read from are regular files (inside its folder for
    an HF folder), checked by stat; a shard index and the safetensors headers are read, no tensor."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint.load_dense={path} does not exist; pass an HF folder, a .safetensors "
                              "or a MiniMind .pth file")
    if not path.is_dir():
        files = [regular_file(path, LOAD_DENSE)]
    elif (file := folder_weights(path)).name == INDEX:
        files = sorted(set(index_shards(path, read_index(file)).values()))
    else:
        files = [file]
    for file in files:  # the library's header checks (offsets, shapes, dtypes): a bad file is an input error
        if file.suffix == ".safetensors":
            SafetensorsFile(file)


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    """A transformers save_pretrained folder: single or sharded safetensors, or pytorch_model.bin."""
    file = folder_weights(folder)
    if file.name == INDEX:
        shards = sorted(set(index_shards(folder, read_index(file)).values()))
        return {k: v for shard in shards for k, v in read_file(shard).items()}
    return read_file(file) if file.name == WEIGHTS else load_weights_only(file)


def read_dense_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The global-key state_dict stored at `path`, on the CPU; safetensors headers checked by the library."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint.load_dense={path} does not exist; pass an HF folder, a .safetensors "
                              "or a MiniMind .pth file")
    if path.is_dir():
        return _read_folder(path)
    regular_file(path, LOAD_DENSE)  # a FIFO would block the read forever
    if path.suffix == ".safetensors":
        return read_file(path)
    state = load_weights_only(path)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a training checkpoint that wraps the weights
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"checkpoint.load_dense={path} is not a state_dict of tensors under string names")
    # torch.compile prefixes names with `_orig_mod.`; the weights are the same.
    return {k.removeprefix("_orig_mod."): v for k, v in state.items()}


def check_keys(expected: set[str], found: set[str], source: str) -> None:
    """Raise one message listing missing and unexpected keys, as strict=True loading would."""
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(f"checkpoint.load_dense={source} does not match model: {'; '.join(parts)}; "
                              "check that the model preset (layers, MoE, vocab) matches the checkpoint")


def fill_ties(state: dict[str, torch.Tensor], ties: dict[str, str]) -> dict[str, torch.Tensor]:
    """Add each tied weight a file stores once (safetensors keeps only the source) under its own name too."""
    for tied, source in ties.items():
        if tied not in state and source in state:
            state[tied] = state[source]
    return state


def convert_layouts(state: dict[str, torch.Tensor], expected: set[str], model_type: str | None) -> dict:
    """Build the model keys transformers stores in another layout (its declared conversions) from `state`."""
    from checkpoint.conversions import build, converted_keys

    for key, (converter, groups) in converted_keys(expected, set(state), model_type).items():
        state[key] = build(converter, groups, state.pop)
    return state


def load_dense_into(model: nn.Module, path: str | Path) -> None:
    """Load a dense checkpoint into the whole (unsharded) model with strict key matching."""
    state = fill_ties(read_dense_state_dict(path), DecoderPlan.of(model).ties)
    state = convert_layouts(state, set(model.state_dict()), model.config.model_type)
    check_keys(set(model.state_dict()), set(state), str(path))
    for name, tensor in model.state_dict().items():
        if tensor.shape != state[name].shape:
            raise CheckpointError(f"checkpoint.load_dense={path}: {name} has shape {tuple(state[name].shape)}, "
                                  f"the model expects {tuple(tensor.shape)}; check the model preset")
        if tensor.is_floating_point() and not state[name].is_floating_point():  # any float precision casts
            raise CheckpointError(f"checkpoint.load_dense={path}: {name} is stored as {state[name].dtype}, but the "
                                  "model's parameter is floating point; the file does not hold this model's weights")
    bad = next((name for name, tensor in state.items() if tensor.is_floating_point()
                and not bool(torch.isfinite(tensor).all())), None)
    if bad is not None:
        raise CheckpointError(f"checkpoint.load_dense={path}: {bad} holds NaN or Inf; refusing non-finite weights")
    model.load_state_dict(state, strict=True)
