"""The memory-mapped token cache, the held-out split, the layout-independent resume position and the
pre-launch batch-size check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.data_helpers import SMALL, all_samples, data_section, make_cfg, spec, write_jsonl
from training.data import (
    DataError,
    StepBatches,
    TensorSamples,
    build_data,
    build_tokenizer,
    build_val_batches,
    data_problem,
    encode_texts,
    synthetic_corpus,
)
from training.data.encode import in_memory
from training.data.samples import PackedSamples, PaddedSamples

TEXTS = synthetic_corpus(120, seed=9)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(spec(**SMALL, cache_dir=str(tmp_path_factory.mktemp("cache")))).save_pretrained(folder)
    return folder


def jsonl_cfg(tmp_path: Path, tokenizer_dir: Path, fmt: str = "packed", **kw):
    path = tmp_path / "docs.jsonl"
    if not path.exists():
        write_jsonl(path, TEXTS)
    geometry = {k: kw.pop(k) for k in ("seq_len", "micro_batch_size", "n_microbatches") if k in kw}
    return make_cfg(data_section(name="jsonl", path=str(path), tokenizer=str(tokenizer_dir), format=fmt,
                                 cache_dir=str(tmp_path / "cache"), **kw), **geometry)


def cache_folders(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "cache" / "tokens").iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("fmt", ["packed", "padded"])
def test_cache_is_used_and_equals_the_in_memory_path(tmp_path, tokenizer_dir, fmt):
    cfg = jsonl_cfg(tmp_path, tokenizer_dir, fmt)
    stream, tokenizer = build_data(cfg, 0, 1)
    [folder] = cache_folders(tmp_path)
    docs = stream.samples.docs
    assert isinstance(docs.tokens, np.memmap) and Path(docs.tokens.filename) == folder / "tokens.bin"
    assert docs.tokens.dtype == np.uint16 and json.loads((folder / "meta.json").read_text())["n_docs"] == len(TEXTS)

    memory = in_memory(encode_texts(tokenizer, TEXTS), None, len(tokenizer))
    assert np.array_equal(docs.tokens, memory.tokens) and np.array_equal(docs.offsets, memory.offsets)
    cls = PackedSamples if fmt == "packed" else PaddedSamples
    args = (32,) if fmt == "packed" else (32, tokenizer.pad_token_id, tokenizer.eos_token_id)
    expected = cls(memory, *args)
    index = torch.arange(len(expected))
    for got, want in zip(all_samples(stream), expected.take(index)):
        assert torch.equal(got, want)

    mtime = (folder / "tokens.bin").stat().st_mtime_ns
    build_data(cfg, 1, 2)  # another replica: reads the cache, never rebuilds it
    assert (folder / "tokens.bin").stat().st_mtime_ns == mtime and cache_folders(tmp_path) == [folder]
    with open(tmp_path / "docs.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more document."}) + "\n")
    build_data(cfg, 0, 1)
    assert len(cache_folders(tmp_path)) == 2  # a changed file gets a fresh cache


def rows(batches) -> set[tuple[int, ...]]:
    return {tuple(r.tolist()) for step in batches for mb in step for r in mb.input_ids}


@pytest.mark.parametrize("fmt", ["packed", "padded"])
def test_val_fraction_is_disjoint_and_layout_independent(tmp_path, tokenizer_dir, fmt):
    cfg = jsonl_cfg(tmp_path, tokenizer_dir, fmt, val_fraction=0.25, seq_len=32, micro_batch_size=2,
                    n_microbatches=2)
    stream, _ = build_data(cfg, 0, 1)
    training = rows(next(stream) for _ in range(3 * len(stream.samples) // 4))  # three epochs
    single = build_val_batches(cfg, 0, 1, n_batches=3)
    assert len(single) == 3 and rows(single).isdisjoint(training)
    assert len(stream.samples) + 0 < len(all_samples(build_data(jsonl_cfg(tmp_path, tokenizer_dir, fmt), 0, 1)[0])[0])
    # Two replicas with half the micro-batches see the same held-out sequences at every eval step.
    half = make_cfg({**cfg.data}, seq_len=32, micro_batch_size=2, n_microbatches=1)
    replicas = [build_val_batches(half, d, 2, n_batches=3) for d in range(2)]
    for k in range(3):
        joined = torch.cat([mb.input_ids for d in range(2) for mb in replicas[d][k]])
        assert torch.equal(joined, torch.cat([mb.input_ids for mb in single[k]]))


def test_val_path_never_appears_in_training(tmp_path, tokenizer_dir):
    val = write_jsonl(tmp_path / "val.jsonl", synthetic_corpus(30, seed=77))
    cfg = jsonl_cfg(tmp_path, tokenizer_dir, "padded", val_path=str(val), seq_len=48)
    stream, tokenizer = build_data(cfg, 0, 1)
    held_out = build_val_batches(cfg, 0, 1, n_batches=100)
    assert len(held_out) == 30 // 4  # only full global batches
    assert rows(held_out).isdisjoint(rows(next(stream) for _ in range(len(TEXTS) // 4)))
    first = held_out[0][0].input_ids[0]
    assert tokenizer.decode(first[first != 0][1:-1]).startswith(synthetic_corpus(30, seed=77)[0][:20])


def test_validation_needs_a_split(tmp_path, tokenizer_dir):
    with pytest.raises(DataError, match="data.val_path=<file> or data.val_fraction>0"):
        build_val_batches(jsonl_cfg(tmp_path, tokenizer_dir), 0, 1, 2)


def numbered(n: int) -> TensorSamples:
    ids = torch.arange(n).repeat_interleave(3).view(n, 3)
    return TensorSamples(ids, ids.clone())


def first_column(micro_batches) -> list[int]:
    return [int(r) for mb in micro_batches for r in mb.input_ids[:, 0]]


def test_resume_position_is_layout_independent():
    samples = numbered(37)
    one = StepBatches(samples, micro_batch_size=2, n_microbatches=4, seed=3)
    reference = [first_column(next(one)) for _ in range(12)]
    one = StepBatches(samples, 2, 4, seed=3)
    for _ in range(5):
        next(one)
    state = one.state_dict()
    assert state == {"samples_consumed": 40, "num_samples": 37, "seed": 3}
    # Resume with dp=2 and one-sample micro-batches: the same global sequences, step by step.
    replicas = [StepBatches(samples, micro_batch_size=1, n_microbatches=4, dp_rank=d, dp_size=2, seed=3)
                for d in range(2)]
    for replica in replicas:
        replica.load_state_dict(state)
    for step in range(5, 12):
        assert first_column(next(replicas[0])) + first_column(next(replicas[1])) == reference[step]
    with pytest.raises(DataError, match="num_samples=37 but this run has num_samples=36"):
        StepBatches(numbered(36), 2, 4, seed=3).load_state_dict(state)


def test_check_data_reports_batch_mismatch(tmp_path, tokenizer_dir):
    few = make_cfg(data_section(**{**SMALL, "num_docs": 3}), seq_len=256, micro_batch_size=8, n_microbatches=4)
    message = data_problem(few)
    assert message.startswith("data: data.num_docs=3 gives at most") and "one global batch of 32 = dp 1" in message
    padded = make_cfg(data_section(**{**SMALL, "num_docs": 40, "format": "padded"}), micro_batch_size=4,
                      n_microbatches=4)
    assert data_problem(padded) is None
    assert "fewer than one global batch of 64 = dp 4" in data_problem(padded, dp=4)
    assert "gives at most 40 training sequences" in data_problem(make_cfg(padded.data, micro_batch_size=4,
                                                                        n_microbatches=4, dp=4))
    small_val = make_cfg(data_section(**{**SMALL, "val_fraction": 0.01, "format": "padded"}), micro_batch_size=4,
                         n_microbatches=4)
    assert data_problem(small_val).startswith("data: the held-out split gives at most")
    lines = jsonl_cfg(tmp_path, tokenizer_dir, "padded", micro_batch_size=16, n_microbatches=8)
    assert "gives at most 121 training sequences" in data_problem(lines)  # a bound: newlines + 1
    with pytest.raises(DataError, match="fewer than one global batch of 128"):
        build_data(lines, 0, 1)


def _build_counting(rank: int, world_size: int, cache: str, marks: str) -> list[int]:
    """Worker: build_data on a shared fresh cache, leaving a marker file per tokenizer training / cache build."""
    import training.data.build as build
    import training.data.tokenizer as tokenizer

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            Path(marks, f"{name}-{rank}").touch()
            return fn(*args, **kwargs)
        return wrapper

    with pytest.MonkeyPatch.context() as mp:  # a pooled worker runs other tests next: undo the patches
        mp.setattr(tokenizer, "train_bpe_tokenizer", counted("train", tokenizer.train_bpe_tokenizer))
        mp.setattr(build, "write_cache", counted("cache", build.write_cache))
        stream, _ = build.build_data(make_cfg(data_section(**SMALL, cache_dir=cache)), rank, world_size)
        return first_column(next(stream))


def test_one_process_trains_and_tokenises_the_others_wait(tmp_path):
    from tests.spawn import run_workers

    marks = tmp_path / "marks"
    marks.mkdir()
    batches = run_workers(_build_counting, 2, str(tmp_path / "cache"), str(marks), timeout=300)
    made = sorted(p.name.split("-")[0] for p in marks.iterdir())
    assert made == ["cache", "train"]  # once each, by whichever rank took the lock first
    assert batches[0] != batches[1]  # two replicas, two different slices of the same data


def test_check_data_is_pure(tmp_path, tokenizer_dir):
    """The pre-launch check trains no tokenizer and writes no cache (issue 7: validation has no side effects)."""
    synthetic = make_cfg(data_section(**SMALL, cache_dir=str(tmp_path / "synthetic")))
    jsonl = jsonl_cfg(tmp_path, tokenizer_dir, skip_bad_lines=True)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert data_problem(synthetic) is None and data_problem(jsonl) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not (tmp_path / "cache").exists()
