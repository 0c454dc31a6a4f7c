"""Pre-launch data validation: one line for a data config, file or tokenizer that cannot work, for data too small
for one global batch, or for chat data whose first rows put every assistant token beyond train.seq_len. Pure: it
reads files and never writes one, trains nothing, tokenises only the first rows of each file."""

import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from training.data.cache import encoded_batches
from training.data.corpus import MIN_DOCUMENT_WORDS, synthetic_corpus
from training.data.encode import Documents, TemplateFailure, in_memory, render_chat
from training.data.labels import unlabeled
from training.data.pairs import PairSamples
from training.data.rows import RowReader
from training.data.samples import make_samples
from training.data.sources import data_source, source_problem
from training.data.spec import (FORMATS, NAMES, PACKED_FORMATS, DataError, DataSpec, Geometry, geometry, optional_field,
                                run_data_spec)
from training.data.split import split_documents, val_count
from training.data.tables import table_bytes
from training.data.tokenizer import EMBEDDED_TOKENIZER, SPECIAL_TOKENS, load_tokenizer, synthetic_tokenizer_dir
from training.data.tool_rows import tool_row_problem

HEAD_LINES = 100  # rows read to catch a wrong file early; the loader checks every row
SCAN_BLOCK = 1 << 20
PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]  # any template renders it


def spec_problem(spec: DataSpec, seq_len: int | None = None) -> str | None:
    """Names, ranges and files of the data section (no file content read beyond its size), then `seq_len` if given."""
    if spec.name not in NAMES:
        return f"data.name: unknown data set '{spec.name}'; use data.name=synthetic or data.name=jsonl"
    if spec.format not in FORMATS:
        return f"data.format: unknown format '{spec.format}'; use one of {', '.join(FORMATS)}"
    if not 0.0 <= spec.val_fraction < 1.0:
        return f"data.val_fraction={spec.val_fraction} must lie in [0, 1)"
    if spec.max_line_bytes < 1:
        return f"data.max_line_bytes={spec.max_line_bytes} must be positive"
    if spec.val_path is not None and spec.val_fraction > 0:
        return "data.val_path and data.val_fraction are both set; hold out a separate file or a fraction, not both"
    if spec.preference and spec.format != "chat":
        return (f"train.task=dpo reads chosen/rejected conversations, each padded to one sample; set data.format=chat "
                f"(here data.format={spec.format})")
    if spec.train_task == "sft" and not spec.chat:
        return (f"train.task=sft trains on conversations; set data.format=chat or chat_packed (here data.format="
                f"{spec.format}), or train.task=pretrain for text")
    if spec.name == "synthetic":
        if spec.format == "chat_packed":  # the embedded conversations are short answers, each padded to one sample
            return "data.format=chat_packed: the embedded conversations are served one per sample; use data.format=chat"
        if spec.num_docs < 1:
            return "data.num_docs: must be >= 1"
        if spec.vocab_size < 256 + len(SPECIAL_TOKENS):
            return f"data.vocab_size: must be >= {256 + len(SPECIAL_TOKENS)} (256 bytes + 3 special tokens)"
    elif problem := source_problem("data.path", spec.path, spec.chat, spec.preference):
        return problem
    if spec.val_path is not None and (problem := source_problem("data.val_path", spec.val_path, spec.chat,
                                                                 spec.preference)):
        return problem
    if spec.name == "jsonl" and spec.tokenizer != EMBEDDED_TOKENIZER:
        hint = f"pass data.tokenizer=<folder with tokenizer.json>, or {EMBEDDED_TOKENIZER} for the embedded one"
        if spec.tokenizer is None:
            return f"data.tokenizer: not set; {hint}"
        if not os.path.isdir(spec.tokenizer):
            return f"data.tokenizer: folder '{spec.tokenizer}' does not exist; {hint}"
        if not any(os.path.isfile(os.path.join(spec.tokenizer, f))
                   for f in ("tokenizer.json", "tokenizer_config.json")):
            return (f"data.tokenizer: folder '{spec.tokenizer}' has neither tokenizer.json nor tokenizer_config.json; "
                    f"{hint}")
    if seq_len is not None and seq_len < 2:
        return f"train.seq_len: {seq_len} is too short; a sample needs at least 2 tokens"
    return None


def _head_problem(spec: DataSpec, key: str, tokenizer: PreTrainedTokenizerBase | None, seq_len: int) -> str | None:
    """A table without the task's columns, the first bad row among the first rows (unless skipped), a source whose
    first rows are all unusable, or chat rows that the chat template fails on or that hold no assistant token within
    seq_len. A Hub dataset is checked when it loads (this check stays offline); without a `tokenizer` (the embedded
    one, not trained yet) chat rows are read, not encoded."""
    source = data_source(spec, key)
    if source.kind == "hub":
        return None
    try:
        rows = source.reader(limit=HEAD_LINES)
        if spec.chat and tokenizer is not None:
            docs, whole = _head_documents(rows, tokenizer, spec, seq_len)
            usable = len(docs)
        else:
            docs, usable = None, sum(1 for _ in rows)
            whole = not rows.cut
    except DataError as error:
        return str(error)
    if source.kind == "jsonl" and spec.task == "chat" and tokenizer is not None and \
            (problem := tool_row_problem(rows, tokenizer, spec.max_line_bytes)):
        return problem  # a tool-use row further down, named before launch
    if whole and usable == 0:
        return f"{key}: no usable text in '{source.path}' (every row is blank or bad); give a file with usable rows"
    if docs is None or usable == 0:
        return None
    samples = make_samples(docs, spec.format, seq_len, tokenizer.pad_token_id, tokenizer.eos_token_id)
    for finding in unlabeled(PairSamples(samples) if spec.preference else samples, key, key == "data.val_path",
                             spec.preference):
        # the first rows decide alone when they are the whole source, or when not one of them holds a label
        if finding.refused and (whole or finding.share == 1.0):
            return finding.refusal()
    return None


def _head_documents(rows: RowReader, tokenizer: PreTrainedTokenizerBase, spec: DataSpec, seq_len: int
                    ) -> tuple[Documents, bool]:
    """The first rows encoded as the token cache encodes them, in memory, and whether they are the whole source: one
    tokenizer call at most (its batch bounds the text), and a padded sample reads no further than seq_len."""
    keep = None if spec.format in PACKED_FORMATS else seq_len
    parts, masks = [], []
    remaining = iter(rows)
    for _, usable in itertools.islice(encoded_batches(remaining, rows.reject, tokenizer, spec.chat,
                                                      spec.preference), 1):
        for docs in usable:
            for ids, labels in docs:
                parts.append(ids[:keep])
                masks.append(labels[:keep])
    whole = next(remaining, None) is None and not rows.cut  # no row left after the first call (one more is read)
    return in_memory(parts, masks, len(tokenizer)), whole


def _line_upper_bound(path: str) -> int:
    """At most this many rows: newlines + 1 (read in blocks, nothing kept)."""
    with open(path, "rb") as f:
        return 1 + sum(block.count(b"\n") for block in iter(lambda: f.read(SCAN_BLOCK), b""))


def _source_bound(spec: DataSpec, key: str, seq_len: int, fraction: float) -> tuple[int, int] | None:
    """Upper bounds on (training, held-out) samples of a source: a token covers at least one byte of a JSONL
    line or of the task's Arrow columns. None for a Hub dataset, which this offline check does not load."""
    source = data_source(spec, key)
    if source.kind == "hub":
        return None
    packed = spec.format in PACKED_FORMATS
    if source.kind == "jsonl":
        rows, size = _line_upper_bound(source.path), os.path.getsize(source.path) if packed else 0
    else:
        table = source.table()
        rows, size = table.num_rows, table_bytes(table, list(source.task.columns)) if packed else 0
    held = val_count(rows, fraction)
    if not packed:
        return rows - held, held
    tokens = size + 2 * rows  # text bytes + bos/eos per row
    return tokens // seq_len, (tokens // seq_len if held else 0)


def _synthetic_bounds(spec: DataSpec, seq_len: int, enough: int) -> tuple[int, int]:
    """Upper bounds on (training, held-out) samples of the synthetic corpus, except that a count at or above `enough`
    may be a lower bound: enough to pass, known from the document count without generating the corpus (a pp=64 run of
    10^5 documents would spend seconds writing text only to count it). Byte-level BPE gives each whitespace-separated
    word at least one token and each byte at most one."""
    train_ids, val_ids = split_documents(spec.num_docs, spec.val_fraction, spec.seed)
    n_train = spec.num_docs if train_ids is None else len(train_ids)
    if spec.format not in PACKED_FORMATS:
        return n_train, len(val_ids)
    least = MIN_DOCUMENT_WORDS + 2  # a word is at least one token; plus bos and eos
    cheap = n_train * least // seq_len, len(val_ids) * least // seq_len
    if cheap[0] >= enough and (len(val_ids) == 0 or cheap[1] >= enough):
        return cheap
    corpus = synthetic_corpus(spec.num_docs, spec.seed)
    train_ids = np.arange(len(corpus)) if train_ids is None else train_ids
    high = np.array([len(d.encode()) + 2 for d in corpus])
    return int(high[train_ids].sum()) // seq_len, int(high[val_ids].sum()) // seq_len


def _batch_problem(spec: DataSpec, geo: Geometry, dp: int) -> str | None:
    """Data too small for one global batch, for training or (when a split is configured) for validation."""
    batch = geo.global_batch(dp)
    if spec.name == "synthetic":
        train, val = _synthetic_bounds(spec, geo.seq_len, batch)
        where = f"data.num_docs={spec.num_docs}"
    else:
        bound = _source_bound(spec, "data.path", geo.seq_len, spec.val_fraction)
        train, val = bound if bound is not None else (batch, batch)  # unknown: the loader checks
        where = f"data.path '{spec.path}'"
    if spec.val_path is not None:
        bound = _source_bound(spec, "data.val_path", geo.seq_len, 0.0)
        val = bound[0] if bound is not None else batch
    pairs = geo.rows_per_sample == 2
    unit = "pairs" if pairs else f"sequences of {geo.seq_len} tokens"
    shape = (f"one global batch of {batch} = dp {dp} x schedule.n_microbatches {geo.n_microbatches} x "
             f"train.micro_batch_size {geo.micro_batch_size}" + (" / 2 (a pair is two sequences)" if pairs else ""))
    if train < batch:
        return (f"data: {where} gives at most {train} training {unit}, fewer than "
                f"{shape}; use more data, a shorter train.seq_len or a smaller batch")
    if (spec.val_path is not None or spec.val_fraction > 0) and val < batch:
        return (f"data: the held-out split gives at most {val} {unit}, fewer than "
                f"{shape}; raise data.val_fraction or give a larger data.val_path")
    return None


def data_problem(cfg: Any, dp: int | None = None) -> str | None:
    """One line for the first problem of the run's data, or None. `dp` defaults to parallel.dp (or 1)."""
    try:
        spec, geo = run_data_spec(cfg), geometry(cfg)
    except DataError as error:
        return str(error)
    problem = spec_problem(spec, geo.seq_len)
    if spec.train_task == "grpo":  # prompts, groups, rewards: GRPO's own check follows (training/methods/grpo/checks.py)
        return problem
    if problem is None and geo.micro_batch_size % geo.rows_per_sample:
        problem = (f"train.micro_batch_size={geo.micro_batch_size} is odd, and under train.task=dpo a micro-batch "
                   "holds whole chosen/rejected pairs (two sequences each); use an even size")
    if problem is None and spec.name == "jsonl":
        tokenizer, problem = _tokenizer(spec)
        for key, path in (("data.path", spec.path), ("data.val_path", spec.val_path)):
            if problem is None and path is not None:
                problem = _head_problem(spec, key, tokenizer, geo.seq_len)
    if problem is None:
        dp = dp or optional_field(optional_field(cfg, "parallel"), "dp") or 1
        try:
            problem = _batch_problem(spec, geo, int(dp))
        except DataError as error:  # a table that does not open
            problem = str(error)
    return problem


def _tokenizer(spec: DataSpec) -> tuple[PreTrainedTokenizerBase | None, str | None]:
    """(tokenizer, problem): the folder's tokenizer, or one line when it does not load (naming the file), lacks a
    chat template for chat, or has one that fails on a plain conversation. The embedded tokenizer once a run trained
    it into data.cache_dir, else None: it is not trained here."""
    embedded = spec.tokenizer == EMBEDDED_TOKENIZER
    folder = synthetic_tokenizer_dir(spec) if embedded else Path(spec.tokenizer)
    if embedded and not (folder / "tokenizer.json").is_file():
        return None, None
    try:
        tokenizer = load_tokenizer(folder)
    except DataError as error:
        return None, f"data.tokenizer: {error}"
    if not spec.chat or embedded:  # the embedded tokenizer's template is CHATML_TEMPLATE
        return tokenizer, None
    if not tokenizer.chat_template:
        return None, (f"data.tokenizer: '{spec.tokenizer}' has no chat_template, which data.format={spec.format} "
                      "needs; use a tokenizer with one (MiniMind's has)")
    try:
        render_chat(tokenizer, PROBE)
    except TemplateFailure as failure:
        return None, (f"data.tokenizer: the chat template of '{spec.tokenizer}' fails on a plain user/assistant "
                      f"conversation ({failure}); fix its chat_template (tokenizer_config.json or chat_template.jinja) "
                      "or use another tokenizer")
    return tokenizer, None
