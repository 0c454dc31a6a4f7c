"""What `data.path` (or `data.val_path`) names, and the one reader each kind gives the token cache.

The kind is read from the path itself: a folder is a `datasets` `save_to_disk` folder, a `.parquet` or `.arrow`
file a table, any other file MiniMind JSONL, and a name that is no local path but reads `owner/name` (or
`owner/name:split`, whose owner is no local folder) a Hub dataset. Every kind yields the same rows (number, payload) in file order, so the same rows
give the same tokens, samples and global order whatever holds them.
"""

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.data.cache import file_identity
from training.data.jsonl import JsonlRows
from training.data.rows import TASKS, RowReader, Task
from training.data.spec import DataError, DataSpec
from training.data.tables import OPENERS, Table, TableRows, missing_columns

TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")  # a missing path with one is a missing file, not a name
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")
SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what `save_to_disk` writes (a Dataset, a DatasetDict)
KINDS = ("jsonl", "parquet", "arrow", "saved", "hub")


def source_kind(path: str) -> str | None:
    """The kind of source `path` names (one of KINDS), or None for a local path that does not exist."""
    local = Path(path)
    if local.is_dir():
        return "saved"
    if local.exists():
        return TABLE_SUFFIXES.get(local.suffix.lower(), "jsonl")
    # A missing path inside an existing folder ("data/corpus" with a "data" folder here) is a typo, not a Hub name.
    if HUB_NAME.fullmatch(path) and local.suffix.lower() not in FILE_SUFFIXES and not local.parent.is_dir():
        return "hub"
    return None


def source_hint(key: str, chat: bool, pairs: bool = False) -> str:
    """The fix for a missing or unusable source."""
    if pairs:
        return (f"pass {key}=<a MiniMind DPO (dpo.jsonl) file, or a .parquet / .arrow file or save_to_disk folder "
                "with \"chosen\" and \"rejected\" columns>")
    column = "conversations" if chat else "text"
    return (f"pass {key}=<a MiniMind {'SFT (conversations)' if chat else 'pretraining'} .jsonl file, or a .parquet / "
            f".arrow file or save_to_disk folder with a \"{column}\" column>")


def source_problem(key: str, path: str | None, chat: bool, pairs: bool = False) -> str | None:
    """A source that is not set, does not exist, is empty, or is a folder `save_to_disk` did not write."""
    hint = source_hint(key, chat, pairs)
    if path is None:
        return f"{key}: not set; {hint}"
    kind = source_kind(path)
    if kind is None:
        return f"{key}: file '{path}' does not exist; {hint}"
    if kind == "saved" and not any(os.path.isfile(os.path.join(path, m)) for m in SAVED_MARKERS):
        return (f"{key}: folder '{path}' is not a `datasets` save_to_disk folder (it has neither "
                f"{' nor '.join(SAVED_MARKERS)}); {hint}")
    if kind in ("jsonl", "parquet", "arrow") and os.path.getsize(path) == 0:
        return f"{key}: file '{path}' is empty; {hint}"
    return None


@dataclass
class Source:
    """One configured source (`data.path` or `data.val_path`): its kind, cache identity and row reader."""

    spec: DataSpec
    key: str
    path: str
    kind: str
    _table: Table | None = field(default=None, repr=False)

    @property
    def task(self) -> Task:
        return TASKS[self.spec.task]

    def table(self) -> Table:
        """The opened table (parquet, Arrow, saved or Hub), once; its columns checked against the task's."""
        if self._table is None:
            try:
                table = OPENERS[self.kind](self.path)
            except DataError as error:
                raise DataError(f"{self.key}: {error}") from None
            reader = "train.task=dpo" if self.spec.preference else f"data.format={self.spec.format}"
            if (problem := missing_columns(table, self.key, self.task, reader)) is not None:
                raise DataError(problem)
            self._table = table
        return self._table

    def label(self) -> str:
        """A readable prefix for the cache folder: the file's stem, the folder's or the Hub dataset's name."""
        if self.kind == "hub":
            return self.path.replace("/", "--").replace(":", "-")
        return Path(self.path).stem if self.kind != "saved" else Path(self.path).resolve().name

    def identity(self) -> dict[str, Any]:
        """What the token cache keys on: the source's identity (file stats, folder stats or Hub fingerprint) and
        the reading rules that change which rows are kept."""
        if self.kind == "jsonl":  # the key JSONL caches were built under before tables existed: they stay valid
            return {**file_identity(self.path), "max_line_bytes": self.spec.max_line_bytes,
                    "skip_bad_lines": self.spec.skip_bad_lines}
        return {**self.table().identity, "kind": self.kind, "skip_bad_lines": self.spec.skip_bad_lines}

    def reader(self, limit: int | None = None) -> RowReader:
        """The source's rows, checked; `limit` stops after that many lines or rows (the pre-launch check)."""
        if self.kind == "jsonl":
            return JsonlRows(self.path, self.key, self.task, self.spec.skip_bad_lines, self.spec.max_line_bytes, limit)
        return TableRows(self.table(), self.key, self.task, self.spec.skip_bad_lines, limit)


def data_source(spec: DataSpec, key: str) -> Source:
    """The source of `key` ("data.path" or "data.val_path"); its problems are one DataError line."""
    path = spec.path if key == "data.path" else spec.val_path
    if (problem := source_problem(key, path, spec.chat, spec.preference)) is not None:
        raise DataError(problem)
    return Source(spec, key, path, source_kind(path))
