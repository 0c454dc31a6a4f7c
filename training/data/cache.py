"""The token cache: a source tokenised once into memory-mapped files, built by one process, read lazily by all.

Layout of one cache folder: `tokens.bin` (uint16/uint32, every document concatenated), `offsets.bin` (int64,
documents + 1), `mask.bin` (uint8 assistant-label mask, chat only) and `meta.json`. A DPO row is two documents side
by side: its chosen conversation, then its rejected one. The key hashes the source
identity, the tokenizer and the reading rules, so a changed file or tokenizer gets a new folder.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from training.data.encode import Documents, TemplateFailure, encode_conversations, encode_texts, token_dtype
from training.data.tokenizer import fingerprint

CACHE_VERSION = 1
BATCH_ROWS = 1024
BATCH_CHARS = 4 << 20  # text per tokenizer call: bounds memory, keeps the tokenizer's threads busy
Rows = Iterable[tuple[int, Any]]  # (line or row number, payload: a text, a conversation or a pair of them)
Doc = tuple[np.ndarray, np.ndarray | None]  # one document's token ids and its label mask (None: text)


def cache_folder(cache_dir: str | Path, label: str, identity: dict[str, Any],
                 tokenizer: PreTrainedTokenizerBase, chat: bool, pairs: bool = False) -> Path:
    """Where the tokens of `identity` (the source and its reading rules) under `tokenizer` are cached."""
    key = {"version": CACHE_VERSION, "source": identity, "chat": chat, "tokenizer": fingerprint(tokenizer)}
    if pairs:  # only then: the keys of text and chat caches stay what they were
        key["pairs"] = True
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / "tokens" / f"{label}-{digest}"


def file_identity(path: str | Path) -> dict[str, Any]:
    """A file's identity for the cache key: real path, size and modification time (no content hash)."""
    stat = os.stat(path)
    return {"path": os.path.realpath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def folder_identity(path: str | Path) -> dict[str, Any]:
    """A folder's identity for the cache key: its real path and each file's relative path, size and mtime."""
    root = Path(path)
    files = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in root.rglob("*") if p.is_file())
    return {"path": os.path.realpath(path), "files": files}


def _size(payload: Any) -> int:
    """Characters of a text, a conversation or a pair of conversations."""
    if isinstance(payload, str):
        return len(payload)
    if isinstance(payload, tuple):
        return sum(_size(part) for part in payload)
    return sum(len(str(t.get("content", ""))) for t in payload)


def _encode(tokenizer: PreTrainedTokenizerBase, payloads: list[Any], chat: bool, pairs: bool
            ) -> list[list[Doc]]:
    """Per row, its documents as (ids, label mask or None): one, or a pair's chosen and rejected."""
    if pairs:
        encoded = encode_conversations(tokenizer, [c for pair in payloads for c in pair])
        return [[chosen, rejected] for chosen, rejected in zip(encoded[0::2], encoded[1::2])]
    if chat:
        return [[doc] for doc in encode_conversations(tokenizer, payloads)]
    return [[(ids, None)] for ids in encode_texts(tokenizer, payloads)]


def _encode_rows(tokenizer: PreTrainedTokenizerBase, payloads: list[Any], chat: bool, pairs: bool
                 ) -> list[list[Doc] | str]:
    """`_encode`, with each row the chat template fails on given as its problem instead (found row by row, once a
    batch failed: the rows that render keep their tokens)."""
    try:
        return _encode(tokenizer, payloads, chat, pairs)
    except TemplateFailure as failure:
        if len(payloads) == 1:
            return [f"the chat template of data.tokenizer fails on it ({failure})"]
        return [row for payload in payloads for row in _encode_rows(tokenizer, [payload], chat, pairs)]


def _unusable(docs: list[Doc], chat: bool, pairs: bool) -> str | None:
    """Why a row's documents cannot train (no tokens, or a conversation without assistant tokens), or None."""
    for which, (ids, labels) in zip(("chosen", "rejected") if pairs else ("",), docs):
        if len(ids) == 0 or (labels is not None and not labels.any()):
            if pairs:
                return f"the {which} conversation has no assistant tokens after the chat template"
            return "no assistant tokens after the chat template" if chat else "no tokens after tokenisation"
    return None


def _batches(rows: Rows) -> Iterator[list[tuple[int, Any]]]:
    """Rows grouped for one tokenizer call each."""
    batch, chars = [], 0
    for row in rows:
        batch.append(row)
        chars += _size(row[1])
        if len(batch) >= BATCH_ROWS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encoded_batches(rows: Rows, reject: Callable[[int, str], None], tokenizer: PreTrainedTokenizerBase, chat: bool,
                    pairs: bool = False, prepare: Callable[[int, Any], Any] | None = None
                    ) -> Iterator[tuple[int, list[list[Doc]]]]:
    """Per tokenizer call: how many rows it read, and the documents of each usable one; a row that does not encode
    (the chat template fails on it, or it leaves no tokens or no assistant token) goes to `reject`. `prepare(number,
    payload)` changes a row before it is encoded (`chat_rules`)."""
    for batch in _batches(rows):
        usable = []
        payloads = [payload if prepare is None else prepare(line, payload) for line, payload in batch]
        for (line, _), docs in zip(batch, _encode_rows(tokenizer, payloads, chat, pairs)):
            problem = docs if isinstance(docs, str) else _unusable(docs, chat, pairs)
            if problem is not None:
                reject(line, problem)
                continue
            usable.append(docs)
        yield len(batch), usable


def write_cache(folder: Path, rows: Rows, reject: Callable[[int, str], None],
                tokenizer: PreTrainedTokenizerBase, chat: bool, progress: Callable[[], int] | None = None,
                total: int | None = None, skipped: Callable[[], int] = lambda: 0, unit: str = "doc",
                pairs: bool = False, prepare: Callable[[int, Any], Any] | None = None) -> None:
    """Tokenise `rows` into `folder` batch by batch (memory bounded by one batch), then rename it into place;
    the bar shows `progress()` of `total` `unit`s (bytes of a JSONL file, rows of a table), or rows counted.
    With `pairs` each row is a (chosen, rejected) pair of conversations, kept as two documents or not at all."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    dtype, lengths = token_dtype(len(tokenizer)), [np.zeros(1, np.int64)]
    bar = tqdm(total=total, desc="tokenizing", unit=unit, unit_scale=True,
               disable=True if total is None else None, leave=False)  # None: off when not a terminal
    try:
        with open(tmp / "tokens.bin", "wb") as tokens, open(tmp / "mask.bin", "wb") as mask:
            for read, rows_docs in encoded_batches(rows, reject, tokenizer, chat, pairs, prepare):
                kept = []
                for docs in rows_docs:
                    for ids, labels in docs:
                        ids.astype(dtype).tofile(tokens)
                        if labels is not None:
                            labels.tofile(mask)
                        kept.append(len(ids))
                lengths.append(np.asarray(kept, np.int64))
                bar.update(progress() - bar.n if progress else read)
        offsets = np.cumsum(np.concatenate(lengths)).astype(np.int64)
        offsets.tofile(tmp / "offsets.bin")
        if not chat:
            (tmp / "mask.bin").unlink()
        meta = {"n_docs": len(offsets) - 1, "n_tokens": int(offsets[-1]), "dtype": dtype.name, "chat": chat,
                "skipped_lines": skipped()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        os.replace(tmp, folder)  # atomic: readers see a whole cache or none
    except OSError:
        if not (folder / "meta.json").exists():
            raise
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)


def open_cache(folder: Path) -> Documents:
    """The cached documents of `folder`, memory-mapped read-only (pages are read when a batch touches them)."""
    meta = json.loads((folder / "meta.json").read_text())
    dtype, n_tokens = np.dtype(meta["dtype"]), meta["n_tokens"]

    def mapped(name: str, kind: np.dtype, count: int) -> np.ndarray:
        return np.memmap(folder / name, dtype=kind, mode="r", shape=(count,)) if count else np.empty(0, kind)

    offsets = np.fromfile(folder / "offsets.bin", dtype=np.int64)  # 8 bytes a document: small enough to read
    mask = mapped("mask.bin", np.dtype(np.uint8), n_tokens) if meta["chat"] else None
    return Documents(mapped("tokens.bin", dtype, n_tokens), offsets, mask, int(meta["skipped_lines"]))


def cached_documents(folder: Path, build: Callable[[], None]) -> Documents:
    """Open `folder`, building it first under a lock: one process tokenises, the others wait, then all read."""
    if not (folder / "meta.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder.parent / f".{folder.name}.lock")):
            if not (folder / "meta.json").exists():
                build()
    return open_cache(folder)
