"""Reading MiniMind JSONL line by line: every row checked, bad rows named by file and line, or skipped and counted.

Hand-written rather than `datasets.load_dataset("json")`: the Arrow JSON reader loads whole blocks (a 30 MB line
becomes several GB), cannot name the line of a bad row, and cannot skip one.
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from training.data.rows import RowReader, Task, read_row

DRAIN_READ_BYTES = 1 << 20  # the rest of an over-long line is read and dropped this many bytes at a time
# Only a \uD800-\uDFFF escape can put a surrogate into a parsed string (a pair of them json joins into one character).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def bounded_lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, bytes or None when longer than `limit`, size): an over-long line is skipped, never held."""
    number = 0
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line) > limit and not line.endswith(b"\n"):
            size = len(line)
            while not line.endswith(b"\n"):
                line = f.readline(DRAIN_READ_BYTES)
                if not line:
                    break
                size += len(line)
            yield number, None, size
        else:
            yield number, line, len(line)


def parse_row(line: bytes, task: Task) -> tuple[Any, str | None]:
    """(payload, problem): what `task` encodes of one JSONL line, or why it is unusable."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, f"invalid UTF-8 at byte {error.start}"
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as error:
        return None, json_problem(decoded, error)
    except RecursionError:  # arrays or objects nested past Python's stack: no row any task reads
        return None, "line is not usable JSON: its arrays or objects nest too deeply"
    if SURROGATE_ESCAPE.search(line):
        if (problem := _lone_surrogate(record)) is not None:
            return None, problem
    return read_row(record, task)


def json_problem(text: str, error: json.JSONDecodeError) -> str:
    """Why a line is not JSON, at the column where it breaks: a line that ends inside a string or before its value
    closes is named as cut short at its end (json names where the unclosed string began)."""
    end = len(text.rstrip("\r\n"))
    if error.msg.startswith("Unterminated string") or error.pos >= end:
        opened = f", in a string opened at column {error.colno}" if error.msg.startswith("Unterminated") else ""
        return (f"line is not JSON: it ends at column {end + 1} before its value is complete{opened} (a truncated "
                "line?)")
    return f"line is not JSON ({error.msg} at column {error.colno})"


def _lone_surrogate(record: Any) -> str | None:
    """A string of the record holding a lone surrogate (valid JSON, but no character: no tokenizer encodes it)."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        escape = f"\\u{ord(error.object[error.start]):04x}"
        return (f"a lone surrogate {escape} (a JSON escape of half a UTF-16 pair: no character, so no tokenizer "
                "encodes it)")
    return None


class JsonlRows(RowReader):
    """The usable rows of one JSONL file as (1-based line number, payload); blank lines are not rows."""

    unit = "line"
    progress_unit = "B"

    def __init__(self, path: str | Path, key: str, task: Task, skip_bad_lines: bool, max_line_bytes: int,
                 limit: int | None = None):
        super().__init__(Path(path), key, task, skip_bad_lines, limit)
        self.max_line_bytes = max_line_bytes
        self.bytes_read = 0
        self.total = self.path.stat().st_size

    def where(self, number: int) -> str:
        return f"{self.path}:{number}"

    def progress(self) -> int:
        return self.bytes_read

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        with open(self.path, "rb") as f:
            for number, line, size in bounded_lines(f, self.max_line_bytes):
                if self.limit is not None and number > self.limit:
                    self.cut = True
                    return
                self.bytes_read += size
                if line is None:
                    self.reject(number, f"line of {size} bytes is longer than data.max_line_bytes="
                                        f"{self.max_line_bytes} (refused, not truncated); raise data.max_line_bytes")
                    continue
                if not line.strip():
                    continue  # blank lines (a trailing newline, spacing) are not rows
                payload, problem = parse_row(line, self.task)
                if problem is not None:
                    self.reject(number, problem)
                    continue
                yield number, payload
