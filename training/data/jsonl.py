"""Reading MiniMind JSONL row by row: every row checked, bad rows named by file and line, or skipped and counted.

Hand-written rather than `datasets.load_dataset("json")`: the Arrow JSON reader loads whole blocks (a 30 MB line
becomes several GB), cannot name the line of a bad row, and cannot skip one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from training.data.spec import DataError

log = logging.getLogger("sluice")
ROLES = ("system", "user", "assistant")
DRAIN_CHUNK = 1 << 20


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
                line = f.readline(DRAIN_CHUNK)
                if not line:
                    break
                size += len(line)
            yield number, None, size
        else:
            yield number, line, len(line)


def _text_problem(record: Any) -> str | None:
    """Why a pretraining row has no usable text, or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object with a \"text\" key"
    if "text" not in record:
        return "no \"text\" key"
    text = record["text"]
    if text is None:
        return "\"text\" is null"
    if not isinstance(text, str):
        return f"\"text\" is a {type(text).__name__}, not a string"
    return "\"text\" is empty" if not text else None


def _chat_problem(record: Any) -> str | None:
    """Why a chat row is not a usable MiniMind conversation, or None."""
    if not isinstance(record, dict) or "conversations" not in record:
        return "no \"conversations\" key"
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        return "\"conversations\" is not a non-empty list"
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            role = turn.get("role") if isinstance(turn, dict) else None
            return f"message {i} has role {role!r}; use one of {', '.join(ROLES)}"
        if not isinstance(turn.get("content"), str):
            return f"message {i} has no string \"content\""
    if not any(t["role"] == "assistant" and t["content"] for t in turns):
        return "no assistant message with content (nothing to learn)"
    return None


def parse_row(line: bytes, chat: bool) -> tuple[Any, str | None]:
    """(payload, problem): the text or the conversation of one JSONL line, or why it is unusable."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, f"invalid UTF-8 at byte {error.start}"
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as error:
        return None, f"line is not JSON ({error.msg} at column {error.colno})"
    problem = _chat_problem(record) if chat else _text_problem(record)
    if problem is not None:
        return None, problem
    return (record["conversations"] if chat else record["text"]), None


class JsonlRows:
    """The usable rows of one JSONL file as (line number, text or conversation); bad rows raise or are counted."""

    def __init__(self, path: str | Path, key: str, chat: bool, max_line_bytes: int, skip_bad_lines: bool):
        self.path, self.key, self.chat = Path(path), key, chat
        self.max_line_bytes, self.skip_bad_lines = max_line_bytes, skip_bad_lines
        self.skipped = 0
        self.first_skipped: str | None = None
        self.bytes_read = 0

    def reject(self, line: int, problem: str) -> None:
        """A bad row: DataError naming file and line, or (with data.skip_bad_lines) counted and skipped."""
        where = f"{self.key}: {self.path}:{line}: {problem}"
        if not self.skip_bad_lines:
            raise DataError(f"{where}; fix or remove the line, or set data.skip_bad_lines=true to skip bad lines")
        self.skipped += 1
        self.first_skipped = self.first_skipped or f"line {line}: {problem}"

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        with open(self.path, "rb") as f:
            for number, line, size in bounded_lines(f, self.max_line_bytes):
                self.bytes_read += size
                if line is None:
                    self.reject(number, f"line of {size} bytes is longer than data.max_line_bytes="
                                        f"{self.max_line_bytes} (refused, not truncated); raise data.max_line_bytes")
                    continue
                if not line.strip():
                    continue  # blank lines (a trailing newline, spacing) are not rows
                payload, problem = parse_row(line, self.chat)
                if problem is not None:
                    self.reject(number, problem)
                    continue
                yield number, payload

    def report(self) -> None:
        """Print the skipped-line count once (called by the one process that read the file)."""
        if self.skipped:
            log.warning("data: skipped %d bad line(s) of %s (data.skip_bad_lines=true); first: %s",
                        self.skipped, self.path, self.first_skipped)
