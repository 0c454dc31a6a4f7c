"""Table sources: a parquet file, an Arrow file, a `datasets` `save_to_disk` folder or a Hub dataset, read as
Arrow batches in row order and checked row by row like JSONL lines (a bad row is named by its 0-based index).

Arrow files, saved folders and Hub datasets open through `datasets`, memory-mapped (pages are read as the
batches reach them). Parquet is read with pyarrow, the engine `datasets` reads it with, one row group at a time:
`Dataset.from_parquet` would first write a whole Arrow copy of the file, and the token cache is the one copy
Sluice needs. Only the columns the task declares are read.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from training.data.cache import file_identity, folder_identity
from training.data.rows import RowReader, Task, read_row
from training.data.saved import saved_folder_problem
from training.data.spec import DataError

BATCH_ROWS = 1024  # rows converted to Python objects at a time: bounds the memory of one batch
DEFAULT_SPLIT = "train"
Batches = Callable[[list[str], int], Iterator[Any]]  # (columns, rows per batch) -> pyarrow tables or batches


@dataclass(frozen=True)
class Table:
    """An opened table source: its columns, its row count, its identity for the cache key, its rows as batches."""

    path: str
    columns: list[str]
    num_rows: int
    identity: dict[str, Any]
    batches: Batches


def _dataset_table(path: str, dataset: Any, identity: dict[str, Any]) -> Table:
    """A `datasets.Dataset` (memory-mapped) as a Table."""
    def batches(columns: list[str], size: int) -> Iterator[Any]:
        return dataset.select_columns(columns).with_format("arrow").iter(batch_size=size)

    return Table(path, list(dataset.column_names), dataset.num_rows, identity, batches)


def _parquet(path: str) -> Table:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path, memory_map=True)
    except Exception as error:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"'{path}' is not a readable parquet file ({_first_line(error)})") from None

    def batches(columns: list[str], size: int) -> Iterator[Any]:
        return parquet.iter_batches(batch_size=size, columns=columns)

    return Table(path, list(parquet.schema_arrow.names), parquet.metadata.num_rows, file_identity(path), batches)


def _arrow(path: str) -> Table:
    """An Arrow file: the IPC stream format `datasets` writes, or the IPC file (Feather v2) format."""
    import datasets
    import pyarrow as pa

    try:
        return _dataset_table(path, datasets.Dataset.from_file(path), file_identity(path))
    except pa.ArrowInvalid:
        pass  # not the stream format: try the file format
    try:
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()  # zero-copy over the memory map
    except pa.ArrowInvalid as error:
        raise DataError(f"'{path}' is not an Arrow file ({_first_line(error)})") from None

    def batches(columns: list[str], size: int) -> Iterator[Any]:
        return iter(table.select(columns).to_batches(max_chunksize=size))

    return Table(path, list(table.column_names), table.num_rows, file_identity(path), batches)


def _split(path: str, loaded: Any, split: str, hint: str) -> Any:
    """The `split` of a DatasetDict (a Dataset passes through); a missing split names the ones there are."""
    import datasets

    if isinstance(loaded, datasets.Dataset):
        return loaded
    if split not in loaded:
        raise DataError(f"'{path}' holds the splits {', '.join(loaded)} and no '{split}'; {hint}")
    return loaded[split]


def _saved(path: str) -> Table:
    """A folder written by `Dataset.save_to_disk` (or a DatasetDict's, whose 'train' split is read)."""
    import datasets

    problem = saved_folder_problem(path)  # before `datasets` trusts its JSON and opens the files it names
    if problem is not None:
        raise DataError(problem)
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as error:  # what the checks cannot see (a damaged Arrow file, odd features): one line too
        raise DataError(f"folder '{path}' is not a readable `datasets` save_to_disk folder ({type(error).__name__}: "
                        f"{_first_line(error)})") from None
    dataset = _split(path, loaded, DEFAULT_SPLIT, "point at one split's folder (<folder>/<split>)")
    return _dataset_table(path, dataset, folder_identity(path))


def _hub(name: str) -> Table:
    """A Hub dataset `owner/name` (split 'train') or `owner/name:split`, downloaded once into the `datasets` cache."""
    import datasets

    repo, _, split = name.partition(":")
    try:
        dataset = datasets.load_dataset(repo, split=split or DEFAULT_SPLIT)
    except Exception as error:  # network, authentication, missing repo or split: all one line
        raise DataError(f"'{name}' is no local file or folder, and loading it as a Hub dataset failed "
                        f"({type(error).__name__}: {_first_line(error)}); check the path, or the dataset name "
                        "and the network") from None
    identity = {"hub": repo, "split": split or DEFAULT_SPLIT, "fingerprint": dataset._fingerprint}
    return _dataset_table(name, dataset, identity)


# A source kind -> its opener: the Table at a path, memory-mapped (nothing is read but its schema).
OPENERS: dict[str, Callable[[str], Table]] = {"parquet": _parquet, "arrow": _arrow, "saved": _saved, "hub": _hub}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _without_nulls(value: Any) -> Any:
    """A conversation without the null fields Arrow adds: a struct column gives every turn every field, so a turn
    written without `tool_calls` reads back with `tool_calls: None`; dropped, the row is the one that was written."""
    if isinstance(value, list):
        return [{k: v for k, v in turn.items() if v is not None} if isinstance(turn, dict) else turn for turn in value]
    return value


def missing_columns(table: Table, key: str, task: Task, reader: str) -> str | None:
    """One line naming the file, the task's columns it lacks (read by `reader`, a setting) and those it has, or None."""
    missing = [c for c in task.columns if c not in table.columns]
    if not missing:
        return None
    lacks = ", ".join(f'"{c}"' for c in missing)
    found = ", ".join(f'"{c}"' for c in table.columns) or "none"
    return (f"{key}: {table.path} has no column{'s' if len(missing) > 1 else ''} {lacks} (its columns: {found}), "
            f"which {reader} reads; "
            f"rename the column or choose the {reader.split('=')[0]} of this data")


class TableRows(RowReader):
    """The usable rows of a table as (0-based row index, payload), read batch by batch in row order."""

    def __init__(self, table: Table, key: str, task: Task, skip_bad_lines: bool, limit: int | None = None):
        super().__init__(table.path, key, task, skip_bad_lines, limit)
        self.table, self.rows_read, self.total = table, 0, table.num_rows

    def progress(self) -> int:
        return self.rows_read

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        columns = list(self.task.columns)
        for batch in self.table.batches(columns, BATCH_ROWS):
            for record in batch.to_pylist():
                if self.limit is not None and self.rows_read == self.limit:
                    self.cut = True
                    return
                index = self.rows_read
                self.rows_read += 1
                payload, problem = read_row({k: _without_nulls(v) for k, v in record.items()}, self.task)
                if problem is not None:
                    self.reject(index, problem)
                    continue
                yield index, payload


def table_bytes(table: Table, columns: list[str]) -> int:
    """Bytes of the task's columns as Arrow holds them: at least their text's UTF-8 bytes (reads the columns)."""
    return sum(batch.nbytes for batch in table.batches(columns, 1 << 16))
