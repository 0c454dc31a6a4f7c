"""Before launch: the shapes a dense checkpoint stores, read from its headers (safetensors) or a memory map (.pth),
against the model's, so `checkpoint.load_dense` of another size is one line before any worker starts, not a rank's
error after launch. No tensor's data is read."""

from __future__ import annotations

from pathlib import Path

from checkpoint.confine import regular_file
from checkpoint.dense import INDEX, LOAD_DENSE, WEIGHTS, CheckpointError, folder_weights, index_shards, \
    mapped_state_dict, read_index
from checkpoint.safetensors_file import SafetensorsFile


def stored_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every key of the dense checkpoint at `path` (an HF folder, a .safetensors or a MiniMind .pth) with its shape."""
    path = Path(path)
    if path.is_dir():
        file = folder_weights(path)
        files = sorted(set(index_shards(path, read_index(file)).values())) if file.name == INDEX else [file]
    else:
        files = [regular_file(path, LOAD_DENSE)]
    if all(f.suffix == ".safetensors" or f.name == WEIGHTS for f in files):
        return {key: shape for f in files for key, (_, shape) in SafetensorsFile(f).table.items()}
    return {key: tuple(value.shape) for key, value in mapped_state_dict(files[0]).items()}  # the shapes, not bytes


def shape_problem(path: str | Path, expected: dict[str, tuple[int, ...]], ties: dict[str, str]) -> str | None:
    """One line naming the first weight whose stored shape differs from the model's (`expected`; a tied weight the
    file stores once is compared through its source), or None. Keys stored in another layout are left to the load."""
    try:
        stored = stored_shapes(path)
    except CheckpointError as error:
        return str(error)
    held = {name: name if name in stored else ties.get(name) for name in expected}  # a tied weight: its source's
    wrong = [(name, stored[held[name]], shape) for name, shape in expected.items()
             if held[name] in stored and tuple(stored[held[name]]) != tuple(shape)]
    if not wrong:
        return None
    name, found, shape = wrong[0]
    more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    return (f"checkpoint.load_dense={path}: {name} has shape {found}, the model expects {shape}{more}; set the model "
            "to the checkpoint's size (model=..., model.hidden_size=..., model.num_hidden_layers=...)")
