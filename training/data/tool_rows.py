"""Before launch: the tool-use rows of a JSONL chat file, wherever they are, rendered once with the chat template.

The pre-launch check reads the first rows of a file; MiniMind's SFT files mix tool-use rows in further down, and a
tokenizer whose template writes no tool calls (or a row whose `tool_calls` is not JSON) would otherwise stop the run
after its workers started, or train on the row with its calls silently missing. The file is read line by line for the
bytes `"tool_calls"` (no JSON parsed for other lines); the first rows that hold them are parsed and rendered.
"""

from typing import Any

from transformers import PreTrainedTokenizerBase

from training.data.encode import TemplateFailure, render_chat
from training.data.jsonl import bounded_lines, parse_row
from training.data.rows import RowReader

MARK = b'"tool_calls"'
CHECKED = 20  # tool rows rendered: a template that drops the calls drops them from every row


def tool_row_problem(rows: RowReader, tokenizer: PreTrainedTokenizerBase, max_line_bytes: int) -> str | None:
    """One line naming the first tool-use row of the JSONL file `rows` reads that is unusable or that the chat
    template fails on or drops the calls of (None under data.skip_bad_lines: the loader skips and counts it)."""
    if rows.skip_bad_lines:
        return None
    seen = 0
    with open(rows.path, "rb") as f:
        for number, line, _ in bounded_lines(f, max_line_bytes):
            if line is None or MARK not in line:
                continue
            payload, problem = parse_row(line, rows.task)
            if problem is None:
                problem = _render_problem(tokenizer, payload)
            if problem is not None:
                return rows.problem_line(number, problem)
            seen += 1
            if seen >= CHECKED:
                return None
    return None


def _render_problem(tokenizer: PreTrainedTokenizerBase, payload: Any) -> str | None:
    """Why the chat template cannot render a conversation (as the token cache words it), or None."""
    try:
        render_chat(tokenizer, payload)
    except TemplateFailure as failure:
        return f"the chat template of data.tokenizer fails on it ({failure})"
    return None
