"""A `datasets` `save_to_disk` folder checked before `datasets` reads it: `load_from_disk` trusts its JSON files
(`state.json` = `[]` ends in a TypeError, a missing field in a KeyError) and opens every Arrow file `state.json`
names, wherever it lies. Here each JSON file must hold the fields `save_to_disk` writes, with their types, and every
data file must sit inside the folder as a regular file (checkpoint/confine.py: refused before any open)."""

import json
from pathlib import Path
from typing import Any

from checkpoint.confine import inside, regular_file
from training.data.spec import DataError

STATE, INFO, SPLITS = "state.json", "dataset_info.json", "dataset_dict.json"
# The fields of state.json that `Dataset.load_from_disk` reads, and the types `save_to_disk` writes them with.
STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "_data_files": (list,), "_fingerprint": (str,), "_format_columns": (list, type(None)), "_format_kwargs": (dict,),
    "_format_type": (str, type(None)), "_output_all_columns": (bool,), "_split": (str, type(None)),
}
FIX = "save the dataset again with Dataset.save_to_disk, or point at a .parquet / .arrow / .jsonl file"
JSON_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null",
              int: "a number", float: "a number"}


def _kind(value: Any) -> str:
    return JSON_NAMES.get(type(value), type(value).__name__)


def _json(folder: Path, name: str) -> Any:
    """The parsed JSON file `name` of the folder (a regular file inside it), or a DataError naming it."""
    path = inside(folder, name, f"folder '{folder}'", DataError)
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(f"'{path}' is not valid JSON ({str(error).splitlines()[0]}); {FIX}") from None


def _dataset_problem(folder: Path) -> str | None:
    """What is wrong with one Dataset's folder (state.json, dataset_info.json, its data files), or None."""
    state = _json(folder, STATE)
    where = folder / STATE
    if not isinstance(state, dict):
        return f"'{where}' is {_kind(state)}, not the object of fields save_to_disk writes; {FIX}"
    for key, types in STATE_FIELDS.items():
        if key not in state:
            return f"'{where}' has no \"{key}\" field; {FIX}"
        if not isinstance(state[key], types):
            wanted = " or ".join(dict.fromkeys(JSON_NAMES[t] for t in types))
            return f"'{where}': \"{key}\" is {_kind(state[key])}, not {wanted}; {FIX}"
    files = state["_data_files"]
    if not files or not all(isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files):
        return f"'{where}': \"_data_files\" must be a non-empty list of {{\"filename\": ...}} objects; {FIX}"
    for entry in files:
        inside(folder, entry["filename"], f"'{where}'", DataError)
    info = _json(folder, INFO)
    if not isinstance(info, dict):
        return f"'{folder / INFO}' is {_kind(info)}, not an object; {FIX}"
    return None


def saved_folder_problem(path: str | Path) -> str | None:
    """One line naming the file of a save_to_disk folder (a Dataset's, or a DatasetDict's and each split's) that
    `datasets` could not read or that names a file outside the folder; None when the folder is well formed."""
    folder = Path(path)
    try:
        if not (folder / SPLITS).exists():
            regular_file(folder / INFO, f"folder '{folder}'", DataError)
            return _dataset_problem(folder)
        splits = _json(folder, SPLITS)
        names = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            return f"'{folder / SPLITS}' must be an object with \"splits\": a non-empty list of split names; {FIX}"
        for name in names:
            split = inside(folder, name, f"'{folder / SPLITS}'", DataError, must_exist=False)
            if not split.is_dir():
                return f"'{folder / SPLITS}' names the split '{name}', which is no folder in '{folder}'; {FIX}"
            if problem := _dataset_problem(split):
                return problem
    except DataError as error:
        return str(error)
    return None
