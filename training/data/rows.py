"""The row contract every data source shares: which columns a task reads, the check of one row, and the reader
base that names a bad row or skips and counts it.

A source (training/data/jsonl.py, training/data/tables.py) yields `(number, payload)` for each usable row in file
order: the number names the row in messages ("line N" of a JSONL file, 1-based as editors count; "row N" of a
table, 0-based as `dataset[N]` and pandas count), the payload is what the task encodes (a text, a conversation).
"""

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.data.spec import DataError

log = logging.getLogger("sluice")
ROLES = ("system", "user", "assistant")
CHAT_ROLES = (*ROLES, "tool")  # MiniMind's SFT rows: tool results answer an assistant's tool calls


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
    return _conversation_problem(record["conversations"], "conversations", CHAT_ROLES)


def _pair_problem(record: Any) -> str | None:
    """Why a preference row is not a usable MiniMind DPO pair (two conversations, `chosen` and `rejected`), or None."""
    for column in ("chosen", "rejected"):
        if not isinstance(record, dict) or column not in record:
            return f"no \"{column}\" key (a DPO row holds \"chosen\" and \"rejected\" conversations)"
        if (problem := _conversation_problem(record[column], column)) is not None:
            return problem if problem.startswith(f"\"{column}\"") else f"\"{column}\": {problem}"
    return None


def _prompt_problem(record: Any) -> str | None:
    """Why a GRPO row (MiniMind's rlaif.jsonl) holds no prompt: a conversation with a user turn to answer, or None."""
    if not isinstance(record, dict) or "conversations" not in record:
        return "no \"conversations\" key"
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        return "\"conversations\" is not a non-empty list"
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            return f"message {i} is not a {{role, content}} message with role one of {', '.join(ROLES)}"
    if not any(t["role"] == "user" and t["content"].strip() for t in turns):
        return "no user turn with content (nothing to answer)"
    return None


def _json_problem(turn: dict[str, Any], field: str, i: int) -> str | None:
    """Why a message's `tools` / `tool_calls` (a list, or MiniMind's JSON text of one) is unusable, or None."""
    value = turn.get(field)
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            return f"message {i}: \"{field}\" is not JSON ({str(error).splitlines()[0]})"
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        return f"message {i}: \"{field}\" is not a list of objects (or the JSON text of one)"
    return None


def _conversation_problem(turns: Any, column: str, roles: tuple[str, ...] = ROLES) -> str | None:
    """Why a list of {role, content} messages (MiniMind's tool rows too: role `tool`, `tools`, `tool_calls`) is not
    a conversation to learn from, or None."""
    if not isinstance(turns, list) or not turns:
        return f"\"{column}\" is not a non-empty list"
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in roles:
            role = turn.get("role") if isinstance(turn, dict) else None
            return f"message {i} has role {role!r}; use one of {', '.join(roles)}"
        calls = turn.get("tool_calls")
        if not isinstance(turn.get("content"), str) and not (calls and turn.get("content") is None):
            return f"message {i} has no string \"content\""
        if problem := _json_problem(turn, "tools", i) or _json_problem(turn, "tool_calls", i):
            return problem
    if not any(t["role"] == "assistant" and (t.get("content") or t.get("tool_calls")) for t in turns):
        return "no assistant message with content or tool calls (nothing to learn)"
    return None


@dataclass(frozen=True)
class Task:
    """What a task reads from a row: the columns it needs, why a row is unusable (or None), and its payload."""

    columns: tuple[str, ...]
    problem: Callable[[Any], str | None]
    payload: Callable[[dict[str, Any]], Any]


# The columns each task declares; a DPO row's payload is its (chosen, rejected) pair of conversations.
TASKS: dict[str, Task] = {
    "text": Task(("text",), _text_problem, lambda row: row["text"]),
    "chat": Task(("conversations",), _chat_problem, lambda row: row["conversations"]),
    "dpo": Task(("chosen", "rejected"), _pair_problem, lambda row: (row["chosen"], row["rejected"])),
    "prompt": Task(("conversations",), _prompt_problem, lambda row: row["conversations"]),
}


# A row's own shape and the train.task that trains on it: a row of another task says which (MiniMind's files are
# one task each: pretrain_*.jsonl text, sft_*.jsonl conversations, dpo.jsonl pairs).
ROW_KINDS = (("chosen", "dpo", "a DPO pair (\"chosen\", \"rejected\")"),
             ("conversations", "sft", "a conversation (\"conversations\")"), ("text", "pretrain", "a text (\"text\")"))
TASK_HINT = "; it is "  # how a problem carrying another task's name starts its hint


def other_task(record: Any, task: Task) -> str | None:
    """The hint for a row shaped for another task than `task` (its kind and the train.task that reads it), or None."""
    if not isinstance(record, dict):
        return None
    for column, train_task, kind in ROW_KINDS:
        if column in record and column not in task.columns:
            return f"{TASK_HINT}{kind}, which train.task={train_task} trains on: set train.task={train_task}"
    return None


def read_row(record: Any, task: Task) -> tuple[Any, str | None]:
    """(payload, problem): what `task` encodes of one row, or why it is unusable (and the train.task that reads it)."""
    problem = task.problem(record)
    if problem is not None and (hint := other_task(record, task)):
        problem += hint
    return (None, problem) if problem is not None else (task.payload(record), None)


class RowReader:
    """The usable rows of one source as (number, payload); a bad row raises a DataError naming the source and the
    row, or (with data.skip_bad_lines) is counted and skipped. Subclasses read the source (`__iter__`)."""

    unit = "row"  # the word for one row in messages
    progress_unit = "row"  # what `progress()` and `total` count (a JSONL file reports bytes)

    def __init__(self, path: str | Path, key: str, task: Task, skip_bad_lines: bool, limit: int | None = None):
        self.path, self.key, self.task, self.skip_bad_lines = path, key, task, skip_bad_lines
        self.limit = limit  # stop after this many lines or rows (the pre-launch check reads the head only)
        self.cut = False  # True once the limit stopped the reading before the end
        self.skipped = 0
        self.first_skipped: str | None = None
        self.total: int | None = None

    def where(self, number: int) -> str:
        """The source and the row, as a message names them."""
        return f"{self.path}: {self.unit} {number}"

    def problem_line(self, number: int, problem: str) -> str:
        """One line naming the bad row, what is wrong and the fix (a row of another task: the train.task that reads
        it, not skipping it)."""
        if TASK_HINT in problem:
            return f"{self.key}: {self.where(number)}: {problem} (or give a file of this task's rows)"
        return (f"{self.key}: {self.where(number)}: {problem}; fix or remove the {self.unit}, or set "
                f"data.skip_bad_lines=true to skip bad {self.unit}s")

    def reject(self, number: int, problem: str) -> None:
        """A bad row: DataError naming source and row, or (with data.skip_bad_lines) counted and skipped."""
        if not self.skip_bad_lines:
            raise DataError(self.problem_line(number, problem))
        self.skipped += 1
        self.first_skipped = self.first_skipped or f"{self.unit} {number}: {problem}"

    def progress(self) -> int:
        """How far the reading is, in `progress_unit`s."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError

    def report(self) -> None:
        """Print the skipped-row count once (called by the one process that read the source)."""
        if self.skipped:
            log.warning("data: skipped %d bad %s(s) of %s (data.skip_bad_lines=true); first: %s",
                        self.skipped, self.unit, self.path, self.first_skipped)
