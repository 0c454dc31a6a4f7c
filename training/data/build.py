"""Entry points for the trainer: the training step stream and the validation batches of one DP replica."""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from parallel.step import MicroBatch
from training.data.cache import cache_folder, cached_documents, write_cache
from training.data.validate import spec_problem
from training.data.corpus import synthetic_corpus
from training.data.encode import Documents
from training.data.pair_corpus import synthetic_conversations, synthetic_pairs
from training.data.pairs import PairBatches, PairSamples, pair_documents
from training.data.labels import Unlabeled, unlabeled
from training.data.samples import Samples, make_samples
from training.data.sources import Source, data_source
from training.data.spec import DataError, DataSpec, Geometry, data_spec, geometry, run_data_spec, section
from training.data.split import split_documents
from training.data.stream import StepBatches
from training.data.tokenizer import CORPUS_VERSION, build_tokenizer, tokenizer_vocab_size
from training.data.prompts import build_prompt_stream

log = logging.getLogger("sluice")


@dataclass(frozen=True)
class Splits:
    """The training samples, the held-out samples (None without a split) and the bad lines skipped."""

    train: Samples
    val: Samples | None
    skipped_lines: int


def _never(line: int, problem: str) -> None:
    raise AssertionError(f"synthetic document {line}: {problem}")  # the embedded corpus has no bad rows


def source_folder(spec: DataSpec, key: str, tokenizer: PreTrainedTokenizerBase,
                  source: Source | None = None) -> Path:
    """The token-cache folder of `key` ("data.path", "data.val_path" or the synthetic corpus); chat rows prepared
    by other rules (data.think, data.system_prompts) are another folder."""
    rules = spec.chat_rules.identity() if spec.chat else {}
    if spec.name == "synthetic":
        identity = {"synthetic": CORPUS_VERSION, "num_docs": spec.num_docs, "seed": spec.seed, **rules}
        kind = "pairs" if spec.preference else "chat" if spec.chat else "seed"
        return cache_folder(spec.cache_dir, f"synthetic-{kind}{spec.seed}-docs{spec.num_docs}", identity,
                            tokenizer, spec.chat, spec.preference)
    source = source or data_source(spec, key)
    return cache_folder(spec.cache_dir, source.label(), {**source.identity(), **rules}, tokenizer, spec.chat,
                        spec.preference)


def row_preparation(spec: DataSpec):
    """What prepares a chat row before tokenising (`chat_rules`), or None when the rows go in as they are."""
    rules = spec.chat_rules
    return rules.prepare if spec.chat and rules.active else None


def source_documents(spec: DataSpec, key: str, tokenizer: PreTrainedTokenizerBase, verbose: bool) -> Documents:
    """The tokenised documents of one source, from its cache (built here by one process if missing)."""
    if spec.name == "synthetic":
        folder = source_folder(spec, key, tokenizer)

        def build() -> None:
            if spec.preference:  # the embedded DPO pairs: one per document of data.num_docs
                corpus = [(row["chosen"], row["rejected"]) for row in synthetic_pairs(spec.num_docs, spec.seed)]
            elif spec.chat:  # the embedded SFT conversations: the pairs' right answers
                corpus = synthetic_conversations(spec.num_docs, spec.seed)
            else:
                corpus = synthetic_corpus(spec.num_docs, spec.seed)
            write_cache(folder, ((i + 1, t) for i, t in enumerate(corpus)), _never, tokenizer, spec.chat,
                        total=len(corpus) if verbose else None, pairs=spec.preference, prepare=row_preparation(spec))
    else:
        source = data_source(spec, key)
        folder = source_folder(spec, key, tokenizer, source)

        def build() -> None:
            rows = source.reader()
            write_cache(folder, rows, rows.reject, tokenizer, spec.chat, progress=rows.progress,
                        total=rows.total if verbose else None, skipped=lambda: rows.skipped,
                        unit=rows.progress_unit, pairs=spec.preference, prepare=row_preparation(spec))
            rows.report()
    documents = cached_documents(folder, build)
    if len(documents) == 0:
        where = "the synthetic corpus" if spec.name == "synthetic" else f"'{source.path}'"
        raise DataError(f"{key}: no usable text in {where} ({documents.skipped_lines} bad rows skipped); "
                        "give a file with usable rows")
    return documents


def build_splits(spec: DataSpec, geo: Geometry, tokenizer: PreTrainedTokenizerBase, verbose: bool) -> Splits:
    """Training and held-out samples: data.val_path, or data.val_fraction of the training documents (of the
    pairs under DPO: a pair is held out whole)."""
    docs = source_documents(spec, "data.path", tokenizer, verbose)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id

    def samples(documents: Documents, ids: np.ndarray | None) -> Samples:
        if spec.preference:
            return PairSamples(make_samples(documents, spec.format, geo.seq_len, pad, eos, pair_documents(ids)))
        return make_samples(documents, spec.format, geo.seq_len, pad, eos, ids)

    if spec.val_path is not None:
        val_docs = source_documents(spec, "data.val_path", tokenizer, verbose)
        return Splits(samples(docs, None), samples(val_docs, None), docs.skipped_lines + val_docs.skipped_lines)
    units = len(docs) // 2 if spec.preference else len(docs)  # documents, or pairs of them
    train_ids, val_ids = split_documents(units, spec.val_fraction, spec.seed)
    val = samples(docs, val_ids) if len(val_ids) else None
    return Splits(samples(docs, train_ids), val, docs.skipped_lines)


def _prepare(cfg: Any, verbose: bool) -> tuple[DataSpec, Geometry, PreTrainedTokenizerBase, Splits]:
    spec, geo = run_data_spec(cfg), geometry(cfg)
    if problem := spec_problem(spec, geo.seq_len):
        raise DataError(problem)
    tokenizer = build_tokenizer(spec)
    splits = build_splits(spec, geo, tokenizer, verbose)
    if spec.chat:
        findings = unlabeled_findings(spec, splits)
        for finding in findings:
            if finding.refused:
                raise DataError(finding.refusal())
        if verbose:  # one rank names the rest; SFT training steps without a label the trainer names as they come
            for finding in findings:
                if finding.share > 0 and (finding.held_out or spec.preference):
                    log.warning(finding.warning())
    return spec, geo, tokenizer, splits


def unlabeled_findings(spec: DataSpec, splits: Splits) -> list[Unlabeled]:
    """The unlabeled share of the training split, then of the held-out one (each side apart under DPO)."""
    found = unlabeled(splits.train, "data.path", False, spec.preference)
    if splits.val is not None:
        key = "data.val_path" if spec.val_path is not None else "data.val_fraction"
        found += unlabeled(splits.val, key, True, spec.preference)
    return found


def build_data(cfg: Any, dp_rank: int, dp_size: int, *, verbose: bool = True
               ) -> tuple[StepBatches, PreTrainedTokenizerBase]:
    """The training step stream of DP replica `dp_rank` of `dp_size`, and the tokenizer, from the run config.
    `verbose` (pass True on one rank only) shows the tokenizing bar and the skipped-line count."""
    if run_data_spec(cfg).train_task == "grpo":  # prompts, held in memory: training.data.prompts
        spec = run_data_spec(cfg)
        tokenizer = build_tokenizer(spec)
        return build_prompt_stream(spec, tokenizer, cfg, dp_rank, dp_size, verbose), tokenizer
    spec, geo, tokenizer, splits = _prepare(cfg, verbose)
    kind = PairBatches if spec.preference else StepBatches  # pairs: the DPO reference log-probabilities ride along
    stream = kind(splits.train, geo.samples_per_micro_batch, geo.n_microbatches, dp_rank, dp_size, geo.seed,
                  skipped_lines=splits.skipped_lines, shuffle=spec.shuffle)
    stream.held_out = splits.val
    return stream, tokenizer


def build_val_batches(cfg: Any, dp_rank: int, dp_size: int, n_batches: int) -> list[list[MicroBatch]]:
    """Up to `n_batches` evaluation steps of held-out micro-batches for this DP replica, in StepBatches' global order
    without shuffling, so every layout with the same global batch sees the same set."""
    _, geo, _, splits = _prepare(cfg, verbose=False)
    if splits.val is None:
        raise DataError("validation needs a held-out split; set data.val_path=<file> or data.val_fraction>0")
    replica = geo.n_microbatches * geo.samples_per_micro_batch
    total = geo.global_batch(dp_size)
    available = len(splits.val) // total
    if available == 0:
        unit = "pairs" if geo.rows_per_sample == 2 else "sequences"
        raise DataError(f"the held-out split has {len(splits.val)} {unit}, fewer than one global batch of "
                        f"{total}; raise data.val_fraction or give a larger data.val_path")
    steps = []
    for k in range(min(n_batches, available)):
        start = k * total + dp_rank * replica
        input_ids, labels = splits.val.take(torch.arange(start, start + replica))
        b = geo.micro_batch_size  # sequences
        tokens = int(splits.val.label_counts(torch.arange(k * total, (k + 1) * total)).sum())  # no collective
        steps.append([MicroBatch(input_ids[i:i + b], labels[i:i + b], tokens) for i in range(0, len(input_ids), b)])
    return steps


def load_tokenizer_vocab_size(cfg: Any) -> int:
    """Token ids the tokenizer of `cfg.data` can produce (the model's vocab must cover it); trains nothing."""
    return tokenizer_vocab_size(data_spec(section(cfg, "data")))
