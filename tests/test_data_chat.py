"""data.format=chat / chat_packed: MiniMind conversations rendered with the chat template, loss only on
assistant tokens (checked on decoded samples)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.data_helpers import SMALL, all_samples, data_section, make_cfg, spec
from training.data import (IGNORE_INDEX, DataError, build_data, build_tokenizer, data_problem, load_tokenizer,
                           synthetic_corpus)
from training.data.pair_corpus import synthetic_conversations, synthetic_pairs

CONVERSATIONS = [
    [{"role": "system", "content": "you are a kind robot."},
     {"role": "user", "content": "what is 17 plus 5?"},
     {"role": "assistant", "content": "17 plus 5 is 22."},
     {"role": "user", "content": "and 3 times 4?"},
     {"role": "assistant", "content": "3 times 4 is 12."}],
    [{"role": "user", "content": "count from 3."},
     {"role": "assistant", "content": "counting: 3 4 5 6 7."}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(spec(**SMALL, cache_dir=str(tmp_path_factory.mktemp("cache")))).save_pretrained(folder)
    return folder


def chat_file(path: Path, conversations: list, repeat: int = 8) -> Path:
    rows = [json.dumps({"conversations": c}) for c in conversations] * repeat
    path.write_text("\n".join(rows) + "\n")
    return path


def chat_cfg(tmp_path: Path, path: Path, tokenizer_dir: Path, fmt: str = "chat", seq_len: int = 64):
    return make_cfg(data_section(name="jsonl", path=str(path), tokenizer=str(tokenizer_dir), format=fmt,
                                 cache_dir=str(tmp_path / "cache")), seq_len=seq_len)


def labelled_text(tokenizer, ids: torch.Tensor, labels: torch.Tensor) -> list[str]:
    """The decoded runs of consecutive labelled tokens of one sample."""
    runs, current = [], []
    for token, label in zip(ids.tolist(), labels.tolist()):
        if label == IGNORE_INDEX:
            if current:
                runs.append(tokenizer.decode(current))
            current = []
        else:
            assert label == token
            current.append(token)
    return runs + ([tokenizer.decode(current)] if current else [])


def test_embedded_tokenizer_has_chatml(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    rendered = tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert rendered == ("<|im_start|>user\ncount from 3.<|im_end|>\n"
                        "<|im_start|>assistant\ncounting: 3 4 5 6 7.<|im_end|>\n")


def test_padded_chat_labels_only_assistant_tokens(tmp_path, tokenizer_dir):
    path = chat_file(tmp_path / "sft.jsonl", CONVERSATIONS)
    cfg = chat_cfg(tmp_path, path, tokenizer_dir, seq_len=96)
    assert data_problem(cfg) is None
    stream, tokenizer = build_data(cfg, 0, 1)
    ids, labels = all_samples(stream)
    assert ids.shape == (16, 96)
    first = tokenizer.decode(ids[0][ids[0] != tokenizer.pad_token_id])
    assert first == tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert labelled_text(tokenizer, ids[0], labels[0]) == ["17 plus 5 is 22.<|im_end|>\n",
                                                           "3 times 4 is 12.<|im_end|>\n"]
    assert labelled_text(tokenizer, ids[1], labels[1]) == ["counting: 3 4 5 6 7.<|im_end|>\n"]
    assert (labels[ids == tokenizer.pad_token_id] == IGNORE_INDEX).all()


def test_packed_chat_keeps_the_mask_across_documents(tmp_path, tokenizer_dir):
    path = chat_file(tmp_path / "sft.jsonl", CONVERSATIONS)
    stream, tokenizer = build_data(chat_cfg(tmp_path, path, tokenizer_dir, fmt="chat_packed", seq_len=32), 0, 1)
    ids, labels = all_samples(stream)
    assert not (ids == tokenizer.pad_token_id).any()
    flat_ids, flat_labels = ids.flatten(), labels.flatten()
    runs = labelled_text(tokenizer, flat_ids, flat_labels)
    replies = [m["content"] + "<|im_end|>\n" for c in CONVERSATIONS for m in c if m["role"] == "assistant"]
    assert runs[: len(replies)] == replies
    assert 0 < int((flat_labels != IGNORE_INDEX).sum()) < flat_labels.numel() // 2


def test_chat_rows_are_checked(tmp_path, tokenizer_dir):
    bad = [[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "hi"}]]
    path = chat_file(tmp_path / "bad.jsonl", CONVERSATIONS + bad, repeat=1)
    message = data_problem(chat_cfg(tmp_path, path, tokenizer_dir))
    assert message.startswith(f"data.path: {path}:3: no assistant message with content"), message
    skipped = make_cfg(data_section(name="jsonl", path=str(path), tokenizer=str(tokenizer_dir), format="chat",
                                    skip_bad_lines=True, cache_dir=str(tmp_path / "c")), seq_len=64,
                       micro_batch_size=1, n_microbatches=1)
    assert build_data(skipped, 0, 1)[0].skipped_lines == 2
    text_file = tmp_path / "text.jsonl"
    text_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in synthetic_corpus(30, 0)))
    assert 'no "conversations" key' in data_problem(chat_cfg(tmp_path, text_file, tokenizer_dir))
    assert data_problem(make_cfg(data_section(**SMALL, format="chat_packed"))) == (
        "data.format=chat_packed: the embedded conversations are served one per sample; use data.format=chat")


def test_the_embedded_data_serves_the_pairs_right_answers_as_conversations(tmp_path):
    """data=synthetic data.format=chat: SFT on the chosen side of the embedded DPO pairs, assistant tokens labelled."""
    cfg = make_cfg(data_section(**{**SMALL, "num_docs": 20}, format="chat", cache_dir=str(tmp_path)), seq_len=128)
    assert data_problem(cfg) is None
    stream, tokenizer = build_data(cfg, 0, 1)
    ids, labels = all_samples(stream)
    rendered = {tokenizer.decode(row[row != tokenizer.pad_token_id]) for row in ids}
    conversations = synthetic_conversations(20, 0)
    assert rendered == {tokenizer.apply_chat_template(c, tokenize=False) for c in conversations}
    replies = {c[-1]["content"] + "<|im_end|>\n" for c in conversations}
    assert {run for i, l in zip(ids, labels) for run in labelled_text(tokenizer, i, l)} == replies
    assert [c[-1] for c in conversations] == [p["chosen"][-1] for p in synthetic_pairs(20, 0)]


def test_tokenizer_without_chat_template_is_refused(tmp_path, tokenizer_dir):
    plain = tmp_path / "plain"
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    path = chat_file(tmp_path / "sft.jsonl", CONVERSATIONS)
    assert "has no chat_template" in data_problem(chat_cfg(tmp_path, path, plain))


LONG_SYSTEM = {"role": "system", "content": " ".join(["you are a careful robot who answers in one line."] * 12)}
CUT = [LONG_SYSTEM, {"role": "user", "content": "and 3 times 4?"}, {"role": "assistant", "content": "12."}]


def test_chat_data_cut_before_most_answers_is_refused(tmp_path, tokenizer_dir):
    path = chat_file(tmp_path / "sft.jsonl", [CUT, CUT, CONVERSATIONS[1]])
    with pytest.raises(DataError, match=r"in 67% of the chat samples \(24 checked\) every assistant token lies "
                                        r"beyond train.seq_len=64, so they would train on nothing"):
        build_data(chat_cfg(tmp_path, path, tokenizer_dir), 0, 1)


def test_a_step_without_labels_warns_with_its_cause(tmp_path, tokenizer_dir, caplog):
    from parallel.grid import ParallelGrid
    from tests.equivalence import compose_run_config
    from training.trainer import Trainer

    path = chat_file(tmp_path / "sft.jsonl", [CUT, CONVERSATIONS[1]])
    cfg = compose_run_config(["model=tiny", "data=jsonl", f"data.path={path}", f"data.tokenizer={tokenizer_dir}",
                              "data.format=chat", "train.seq_len=64", "train.micro_batch_size=1",
                              "schedule.n_microbatches=1", "train.steps=8", "checkpoint.save_final=false"],
                             tmp_path / "cache")
    with caplog.at_level("WARNING", logger="sluice"):
        losses = Trainer(cfg, ParallelGrid.single("cpu"), tmp_path / "run").fit()
    empty = [step for step, loss in enumerate(losses, 1) if loss == 0.0]
    assert empty, losses
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    cause = "every assistant token of their samples lies beyond train.seq_len=64"
    assert warnings[0] == f"step {empty[0]} has no label token on any rank: loss 0 and no gradient ({cause}; raise " \
                          "train.seq_len or use shorter conversations)"
    if len(empty) > 1:
        assert warnings[-1].startswith(f"{len(empty)} of 8 steps ({', '.join(map(str, empty))}) had no label token")


def test_jsonl_data_can_use_the_embedded_tokenizer(tmp_path):
    path = chat_file(tmp_path / "sft.jsonl", CONVERSATIONS)
    cfg = chat_cfg(tmp_path, path, "synthetic", seq_len=96)  # data.tokenizer=synthetic: no folder needed
    assert data_problem(cfg) is None
    stream, tokenizer = build_data(cfg, 0, 1)
    ids, labels = all_samples(stream)
    assert labelled_text(tokenizer, ids[1], labels[1]) == ["counting: 3 4 5 6 7.<|im_end|>\n"]
