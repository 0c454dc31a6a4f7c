"""Documents -> token ids: pretraining text as [bos] + tokens + [eos], chat rendered with the chat template
and an assistant-only label mask. Token ids are stored per document, independent of seq_len and format."""

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from training.data.chat_rules import finish

# Texts longer than this are tokenised in pieces cut before a space: a whole-text Encoding (token strings,
# offsets, alignments) costs ~100 bytes per input byte, and the tokenizer slows down on very long inputs.
PIECE_CHARS = 1 << 14
CALL_CHARS = 1 << 20  # characters per tokenizer call: bounds the memory of one call's encodings
_CUT = re.compile(r" (?=\S)")


@dataclass(frozen=True)
class Documents:
    """Tokenised documents, concatenated: doc i is tokens[offsets[i]:offsets[i+1]] (arrays may be memmaps)."""

    tokens: np.ndarray  # [T] unsigned ints
    offsets: np.ndarray  # [D + 1] int64, offsets[0] == 0
    mask: np.ndarray | None  # [T] uint8, 1 = a label (assistant token); None = every token is a label
    skipped_lines: int = 0

    def __len__(self) -> int:
        return len(self.offsets) - 1


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _pieces(text: str) -> list[str]:
    """`text` cut before spaces into pieces of about PIECE_CHARS (byte-level BPE never merges across)."""
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        match = _CUT.search(text, start + PIECE_CHARS)
        if match is None:
            break
        pieces.append(text[start:match.start()])
        start = match.start()
    pieces.append(text[start:])
    return pieces


def _ids(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text (no specials added), long texts in pieces, at most CALL_CHARS per call."""
    parts: list[list[np.ndarray]] = [[] for _ in texts]
    batch: list[tuple[int, str]] = []
    chars = 0

    def flush() -> None:
        encoded = tokenizer([p for _, p in batch], add_special_tokens=False, return_attention_mask=False)
        for (owner, _), ids in zip(batch, encoded["input_ids"]):
            parts[owner].append(np.asarray(ids, dtype=np.int64))
        batch.clear()

    for owner, text in enumerate(texts):
        for piece in _pieces(text):
            batch.append((owner, piece))
            chars += len(piece)
            if chars >= CALL_CHARS:
                flush()
                chars = 0
    if batch:
        flush()
    return [np.concatenate(p) if p else np.empty(0, np.int64) for p in parts]


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[np.ndarray]:
    """Each pretraining text as [bos] + tokens + [eos]; a text with no tokens gives an empty array."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [np.concatenate(([bos], ids, [eos])) if len(ids) else ids for ids in _ids(tokenizer, texts)]


def _find(ids: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Start positions of `pattern` in `ids`."""
    if len(ids) < len(pattern) or len(pattern) == 0:
        return np.empty(0, np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(ids, len(pattern))
    return np.flatnonzero((windows == pattern).all(axis=1))


def assistant_mask(ids: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """MiniMind's SFT rule: label from after each `start` pattern through the next `end` pattern (inclusive)."""
    mask = np.zeros(len(ids), np.uint8)
    starts, ends = _find(ids, start), _find(ids, end)
    covered = 0
    for s in starts:
        if s < covered:
            continue
        begin = s + len(start)
        later = ends[ends >= begin]
        stop = int(later[0]) + len(end) if len(later) else len(ids)
        mask[begin:stop] = 1
        covered = stop
    return mask


def chat_patterns(tokenizer: PreTrainedTokenizerBase) -> tuple[np.ndarray, np.ndarray]:
    """The token patterns that open an assistant reply and close a message (MiniMind's bos_id / eos_id)."""
    start = tokenizer(f"{tokenizer.bos_token}assistant\n", add_special_tokens=False)["input_ids"]
    end = tokenizer(f"{tokenizer.eos_token}\n", add_special_tokens=False)["input_ids"]
    return np.asarray(start, np.int64), np.asarray(end, np.int64)


class TemplateFailure(ValueError):
    """The tokenizer's chat template raised on a conversation; the message is the error it raised, in one line."""


def _decoded(value: Any) -> Any:
    """A `tools` / `tool_calls` value as the template reads it: MiniMind's rows hold JSON text (json.loads'ed)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as error:
        raise TemplateFailure(f"not JSON: {value[:40]!r} ({str(error).splitlines()[0]})") from None


def chat_messages(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """(messages, tools) as MiniMind's SFTDataset hands them to the template: `tool_calls` decoded, the system
    message's `tools` passed as the template's tools, an assistant's missing content (a tool call alone) empty."""
    messages, tools = [], None
    for turn in conversation:
        turn = dict(turn)
        if turn.get("role") == "system" and turn.get("tools"):
            tools = _decoded(turn["tools"])
        if turn.get("tool_calls"):
            turn["tool_calls"] = _decoded(turn["tool_calls"])
        if turn.get("content") is None:
            turn["content"] = ""
        messages.append(turn)
    return messages, tools


def _call_names(messages: list[dict[str, Any]]) -> list[str]:
    """The function names of the conversation's tool calls (OpenAI's {function: {...}} form or MiniMind's flat one)."""
    calls = [c for m in messages for c in (m.get("tool_calls") or []) if isinstance(c, dict)]
    return [str(c.get("function", c).get("name")) for c in calls if isinstance(c.get("function", c), dict)]


def render_chat(tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, Any]]) -> str:
    """The conversation as the tokenizer's chat template renders it (tools and tool calls as MiniMind passes them,
    `open_thinking` from the row's rules); a template that raises, or drops a tool call -> TemplateFailure."""
    messages, tools = chat_messages(conversation)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             open_thinking=getattr(conversation, "open_thinking", None) is True)
    except Exception as error:  # the template is the tokenizer folder's own Jinja program: it may raise anything
        first = (str(error).strip().splitlines() or [""])[0]
        raise TemplateFailure(f"{type(error).__name__}{': ' + first if first else ''}") from None
    if dropped := [name for name in _call_names(messages) if name not in text]:
        raise TemplateFailure(f"it renders no tool calls (the call to {dropped[0]!r} is missing from the text, so it "
                              "would not be learned); use a tokenizer whose chat template renders tool_calls, as "
                              "MiniMind's does")
    return text


def encode_conversations(tokenizer: PreTrainedTokenizerBase,
                         conversations: list[list[dict[str, Any]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, assistant-only label mask) of each conversation rendered with the chat template and its think rule."""
    texts = [finish(c, render_chat(tokenizer, c)) for c in conversations]
    start, end = chat_patterns(tokenizer)
    return [(ids, assistant_mask(ids, start, end)) for ids in _ids(tokenizer, texts)]


def in_memory(parts: list[np.ndarray], masks: list[np.ndarray] | None, vocab_size: int) -> Documents:
    """Documents held in memory from per-document arrays."""
    lengths = np.fromiter((len(p) for p in parts), np.int64, len(parts))
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    dtype = token_dtype(vocab_size)
    tokens = np.concatenate(parts).astype(dtype) if parts else np.empty(0, dtype)
    mask = None if masks is None else (np.concatenate(masks) if masks else np.empty(0, np.uint8))
    return Documents(tokens, offsets, mask)
