"""Tests for training/data: corpus, tokenizer, sample formats, the DP step stream, resume, checks."""

from __future__ import annotations

import collections
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.data_helpers import SMALL, all_samples, data_section, make_cfg, spec, write_jsonl
from training.data import (
    IGNORE_INDEX,
    MicroBatch,
    StepBatches,
    TensorSamples,
    build_data,
    build_tokenizer,
    data_problem,
    load_tokenizer,
    load_tokenizer_vocab_size,
    save_atomically,
    synthetic_corpus,
    synthetic_tokenizer_dir,
    train_bpe_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A MiniMind-style tokenizer folder trained on a small synthetic corpus."""
    cache = tmp_path_factory.mktemp("cache")
    tokenizer = build_tokenizer(spec(**SMALL, cache_dir=str(cache)))
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


# ---------------------------------------------------------------------------------- corpus


def test_corpus_is_deterministic_and_varied():
    a, b = synthetic_corpus(50, seed=3), synthetic_corpus(50, seed=3)
    assert a == b
    assert a != synthetic_corpus(50, seed=4)
    lengths = [len(doc.split()) for doc in synthetic_corpus(300, seed=0)]
    assert min(lengths) >= 20 and max(lengths) <= 260
    assert max(lengths) - min(lengths) > 100  # lengths vary


def test_corpus_has_structure(tokenizer):
    """Bigram conditional entropy of the token stream is far below the unigram entropy."""
    ids = [i for doc in synthetic_corpus(400, seed=1) for i in tokenizer(doc, add_special_tokens=False)["input_ids"]]
    n = len(ids)
    unigram = collections.Counter(ids)
    h_unigram = -sum(c / n * math.log2(c / n) for c in unigram.values())
    previous = collections.Counter(ids[:-1])
    pairs = collections.Counter(zip(ids, ids[1:]))
    h_bigram = -sum(c / (n - 1) * math.log2(c / previous[a]) for (a, _), c in pairs.items())
    assert h_bigram < h_unigram - 1.5, (h_unigram, h_bigram)


# ---------------------------------------------------------------------------------- tokenizer


def test_tokenizer_special_ids_and_round_trip(tokenizer):
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert 259 < len(tokenizer) <= 512
    text = "the code of apple is 42. 17 plus 5 is 22. counting: 3 4 5 6 7. Unseen: é ü 🙂!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer("the cat", add_special_tokens=False)["input_ids"][0] not in (0, 1, 2)  # no implicit bos


def test_tokenizer_is_cached_not_rebuilt(tmp_path):
    data = spec(**SMALL, cache_dir=str(tmp_path))
    first = build_tokenizer(data)
    folder = synthetic_tokenizer_dir(data)
    assert folder.parent == tmp_path and (folder / "tokenizer.json").is_file()
    mtime = (folder / "tokenizer.json").stat().st_mtime_ns
    second = build_tokenizer(data)
    assert (folder / "tokenizer.json").stat().st_mtime_ns == mtime
    assert first.get_vocab() == second.get_vocab()
    assert [n for n in os.listdir(tmp_path) if not n.endswith(".lock")] == [folder.name]  # no temporary folders
    other = synthetic_tokenizer_dir(spec(**{**SMALL, "vocab_size": 600}, cache_dir=str(tmp_path)))
    assert other != folder  # corpus parameters name the folder


def test_concurrent_save_keeps_the_winner(tmp_path, tokenizer):
    target = tmp_path / "tok"
    save_atomically(tokenizer, target)
    mtime = (target / "tokenizer.json").stat().st_mtime_ns
    save_atomically(tokenizer, target)  # a late process: its copy is discarded, no error
    assert (target / "tokenizer.json").stat().st_mtime_ns == mtime
    assert os.listdir(tmp_path) == ["tok"]


def test_weights_trained_with_another_tokenizer_are_refused_in_one_line(tmp_path, tokenizer_dir, capsys):
    """The embedded tokenizer depends on data.num_docs and data.seed: fine-tuning an export under other values would
    read its token ids as other words, silently (the recipe's DPO step once did, and answered nonsense). Refused
    before launch."""
    from training.launch.cli import preflight
    from training.config import register_schema
    from training.data import weights_tokenizer_problem

    same = spec(**SMALL, cache_dir=str(tmp_path))
    assert weights_tokenizer_problem(tokenizer_dir, same) is None
    assert weights_tokenizer_problem(None, same) is None
    assert weights_tokenizer_problem(tmp_path, same) is None  # no tokenizer.json beside the weights
    other_spec = spec(**{**SMALL, "num_docs": 200}, cache_dir=str(tmp_path))
    line = weights_tokenizer_problem(tokenizer_dir, other_spec)
    assert line.startswith(f"checkpoint.load_dense={tokenizer_dir} was trained with another tokenizer than this run's "
                           "(the embedded tokenizer of data.num_docs=200, data.seed=0): "), line
    assert line.endswith(" tokens have other ids there; set data.num_docs and data.seed to those of the run that "
                         "trained the weights"), line
    other = tmp_path / "other"
    build_tokenizer(other_spec).save_pretrained(str(other))
    jsonl = spec(name="jsonl", tokenizer=str(other), cache_dir=str(tmp_path))
    line = weights_tokenizer_problem(tokenizer_dir, jsonl)
    assert f"(data.tokenizer={other})" in line and line.endswith(f"; set data.tokenizer={tokenizer_dir}")

    register_schema()
    with pytest.raises(SystemExit) as leave:
        preflight(["model=tiny", "data.num_docs=200", "data.vocab_size=512", f"data.cache_dir={tmp_path}",
                   f"checkpoint.load_dense={tokenizer_dir}"])
    assert leave.value.code == 2
    assert capsys.readouterr().err.strip().startswith(
        f"sluice: config error: checkpoint.load_dense={tokenizer_dir} was trained with another tokenizer")


def test_tokenizer_training_is_deterministic():
    corpus = synthetic_corpus(100, seed=0)
    a, b = train_bpe_tokenizer(corpus, 400), train_bpe_tokenizer(corpus, 400)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


# ---------------------------------------------------------------------------------- formats


def test_padded_format_layout(tmp_path, tokenizer_dir, tokenizer):
    short, long = "the cat sees the dog.", " ".join(["the big dog runs in the park."] * 20)
    path = write_jsonl(tmp_path / "tiny.jsonl", [short, long, "1 plus 2 is 3."])
    seq_len = 16
    cfg = make_cfg(
        data_section(name="jsonl", path=str(path), tokenizer=str(tokenizer_dir), format="padded",
                     cache_dir=str(tmp_path / "cache")),
        seq_len=seq_len, micro_batch_size=1, n_microbatches=3,
    )
    assert data_problem(cfg) is None
    stream, _ = build_data(cfg, dp_rank=0, dp_size=1)
    ids, labels = all_samples(stream)
    assert ids.shape == (3, seq_len) and ids.dtype == torch.long

    tokens = tokenizer(short, add_special_tokens=False)["input_ids"]
    expected = [1, *tokens, 2] + [0] * (seq_len - len(tokens) - 2)
    assert ids[0].tolist() == expected
    assert labels[0].tolist() == [t if t != 0 else IGNORE_INDEX for t in expected]

    tokens = tokenizer(long, add_special_tokens=False)["input_ids"]
    assert ids[1].tolist() == [1, *tokens[: seq_len - 2], 2]  # truncated, no pad
    assert torch.equal(labels[1], ids[1])

    micro_batches = next(stream)
    assert len(micro_batches) == 3 and all(mb.input_ids.shape == (1, seq_len) for mb in micro_batches)


def test_packed_format_cuts_samples_without_pads(tmp_path, tokenizer_dir, tokenizer):
    texts = synthetic_corpus(20, seed=5)
    path = write_jsonl(tmp_path / "docs.jsonl", texts)
    seq_len = 24
    cfg = make_cfg(
        data_section(name="jsonl", path=str(path), tokenizer=str(tokenizer_dir), format="packed",
                     cache_dir=str(tmp_path / "cache")),
        seq_len=seq_len,
    )
    stream, _ = build_data(cfg, 0, 1)
    ids, labels = all_samples(stream)
    flat = [t for text in texts for t in [1, *tokenizer(text, add_special_tokens=False)["input_ids"], 2]]
    n = len(flat) // seq_len
    assert ids.shape == (n, seq_len)
    assert ids.flatten().tolist() == flat[: n * seq_len]  # documents in order, remainder dropped
    assert torch.equal(labels, ids) and not (ids == 0).any()


def test_synthetic_packed_and_padded_via_build_data(tmp_path):
    data = data_section(**SMALL, cache_dir=str(tmp_path))
    packed, tok = build_data(make_cfg(data, seq_len=64), 0, 1)
    packed_ids = all_samples(packed)[0]
    assert packed_ids.shape[1] == 64 and not (packed_ids == 0).any()
    assert (packed_ids == 1).sum() > 0 and (packed_ids == 2).sum() > 0
    padded, _ = build_data(make_cfg({**data, "format": "padded"}, seq_len=64), 0, 1)
    padded_ids = all_samples(padded)[0]
    assert padded_ids.shape == (SMALL["num_docs"], 64)
    assert (padded_ids[:, 0] == 1).all()
    assert load_tokenizer_vocab_size(make_cfg(data)) == len(tok)


def test_build_data_accepts_plain_objects(tmp_path):
    cfg = SimpleNamespace(
        data=SimpleNamespace(**data_section(**SMALL, cache_dir=str(tmp_path))),
        train=SimpleNamespace(seq_len=32, micro_batch_size=2, seed=0),
        schedule=SimpleNamespace(n_microbatches=2),
    )
    stream, _ = build_data(cfg, 1, 2)
    assert [mb.input_ids.shape for mb in next(stream)] == [(2, 32), (2, 32)]


# ---------------------------------------------------------------------------------- step stream


def numbered_samples(n: int, seq_len: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i is filled with i, so a micro-batch shows which samples it holds."""
    ids = torch.arange(n).repeat_interleave(seq_len).view(n, seq_len)
    return ids, ids.clone()


def rows(micro_batches: list[MicroBatch]) -> list[int]:
    return [int(r) for mb in micro_batches for r in mb.input_ids[:, 0]]


def test_dp_slicing_matches_single_replica():
    ids, labels = numbered_samples(50)
    single = StepBatches(TensorSamples(ids, labels), micro_batch_size=2, n_microbatches=8, seed=7)
    replicas = [StepBatches(TensorSamples(ids, labels), 2, 4, dp_rank=d, dp_size=2, seed=7) for d in range(2)]
    for _ in range(10):  # 160 sequences: crosses three epoch boundaries
        expected = rows(next(single))
        assert rows(next(replicas[0])) + rows(next(replicas[1])) == expected
    # The global stream is the concatenation of seeded epoch permutations.
    stream = StepBatches(TensorSamples(ids, labels), micro_batch_size=5, n_microbatches=2, seed=7)
    got = [r for _ in range(10) for r in rows(next(stream))]
    perms = [torch.randperm(50, generator=torch.Generator().manual_seed(7 + e)).tolist() for e in range(2)]
    assert got == perms[0] + perms[1]


def test_without_shuffle_every_layout_reads_the_data_in_order():
    ids, labels = numbered_samples(20)
    single = StepBatches(TensorSamples(ids, labels), micro_batch_size=2, n_microbatches=4, seed=7, shuffle=False)
    replicas = [StepBatches(TensorSamples(ids, labels), 2, 2, dp_rank=d, dp_size=2, seed=7, shuffle=False)
                for d in range(2)]
    got = [r for _ in range(5) for r in rows(next(single))]  # 40 sequences: two epochs, each in data order
    assert got == list(range(20)) * 2
    assert [r for _ in range(5) for d in range(2) for r in rows(next(replicas[d]))] == got


def test_the_data_shuffle_key_reaches_the_stream(tmp_path):
    cfg = make_cfg(data_section(**SMALL, cache_dir=str(tmp_path), shuffle=False), seq_len=16)
    stream, _ = build_data(cfg, 0, 1, verbose=False)
    assert stream.shuffle is False and stream.indices_at(0).tolist() == list(range(4))


def test_micro_batches_are_contiguous_slices():
    ids, labels = numbered_samples(40)
    stream = StepBatches(TensorSamples(ids, labels), micro_batch_size=3, n_microbatches=2, dp_rank=1, dp_size=2, seed=0)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    micro_batches = stream.batch(1)  # step 1, replica 1: global positions 12 + 6 .. 12 + 12
    assert [rows([mb]) for mb in micro_batches] == [perm[18:21], perm[21:24]]
    assert all(mb.input_ids.dtype == torch.long and mb.labels.dtype == torch.long for mb in micro_batches)


def test_state_dict_resume():
    ids, labels = numbered_samples(30)
    stream = StepBatches(TensorSamples(ids, labels), 2, 2, seed=1)
    seen = [rows(next(stream)) for _ in range(12)]
    restarted = StepBatches(TensorSamples(ids, labels), 2, 2, seed=1)
    stream = StepBatches(TensorSamples(ids, labels), 2, 2, seed=1)
    for _ in range(5):
        next(stream)
    state = stream.state_dict()
    assert state == {"samples_consumed": 20, "num_samples": 30, "seed": 1}
    restarted.load_state_dict(state)
    assert [rows(next(restarted)) for _ in range(7)] == seen[5:]


def test_too_small_data_set_errors():
    ids, labels = numbered_samples(7)
    with pytest.raises(ValueError, match="fewer than one global batch of 8"):
        StepBatches(TensorSamples(ids, labels), micro_batch_size=2, n_microbatches=2, dp_rank=0, dp_size=2)


def test_num_label_tokens():
    labels = torch.tensor([[5, 6, -100, -100], [-100, 7, 8, 9]])
    assert MicroBatch(labels.clamp(min=0), labels).num_label_tokens() == 4  # position 0 never counts


# ---------------------------------------------------------------------------------- data_problem


def test_check_data_messages(tmp_path, tokenizer_dir):
    def jsonl(path, tokenizer=str(tokenizer_dir)):
        return make_cfg(data_section(name="jsonl", path=str(path), tokenizer=tokenizer))

    assert data_problem(make_cfg(data_section(**SMALL))) is None

    missing = data_problem(jsonl(tmp_path / "x.jsonl"))
    assert missing.startswith("data.path: file") and "does not exist" in missing and "data.path=" in missing

    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not json\n")
    assert "is not JSON" in data_problem(jsonl(bad))

    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"content": "hi"}\n')
    assert 'no "text" key' in data_problem(jsonl(no_text))

    good = write_jsonl(tmp_path / "good.jsonl", synthetic_corpus(20, seed=0))  # more than one global batch
    assert data_problem(jsonl(good)) is None
    message = data_problem(jsonl(good, tokenizer=str(tmp_path / "nope")))
    assert message.startswith("data.tokenizer: folder") and "does not exist" in message
    (tmp_path / "empty").mkdir()
    assert "neither tokenizer.json nor tokenizer_config.json" in data_problem(jsonl(good, str(tmp_path / "empty")))
    assert "data.name" in data_problem(make_cfg(data_section(name="parquet")))
    assert "data.format" in data_problem(make_cfg(data_section(format="ragged")))
    with pytest.raises(ValueError, match="data.path"):
        build_data(jsonl(tmp_path / "x.jsonl"), 0, 1)
