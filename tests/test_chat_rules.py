"""Chat data as MiniMind prepares it, as options: data.think (keep, drop, MiniMind's 80% drop of the empty think block)
and system prompts from a list, each row's draw fixed by data.seed; data.format follows train.task unless set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.data_helpers import SMALL, all_samples, data_section, make_cfg, spec
from training.config.schema import compose_config
from training.data import build_data, build_tokenizer
from training.data.chat_rules import EMPTY_THINK, ChatRules
from training.data.spec import run_data_spec

# MiniMind's template, reduced to what matters here: an assistant reply without reasoning opens with an empty block.
THINK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}")
ROWS = 200


@pytest.fixture(scope="module")
def think_data(tmp_path_factory) -> tuple[Path, Path]:
    """A tokenizer whose template writes the empty think block, and ROWS distinct conversations."""
    root = tmp_path_factory.mktemp("think")
    tokenizer = build_tokenizer(spec(**SMALL, cache_dir=str(root / "cache")))
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(root / "tokenizer")
    rows = [{"conversations": [{"role": "user", "content": f"count from {i}."},
                               {"role": "assistant", "content": f"counting {i}."}]} for i in range(ROWS)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "tokenizer", root / "sft.jsonl"


def rendered(think_data, tmp_path: Path, **data) -> list[str]:
    """The decoded training samples (set order) of the think data under the given data keys."""
    tokenizer_dir, path = think_data
    cfg = make_cfg(data_section(name="jsonl", path=str(path), tokenizer=str(tokenizer_dir), format="chat",
                                cache_dir=str(tmp_path / "cache"), shuffle=False, **data), seq_len=64)
    stream, tokenizer = build_data(cfg, 0, 1, verbose=False)
    ids, _ = all_samples(stream)
    return [tokenizer.decode(row[row != tokenizer.pad_token_id]) for row in ids]


def test_think_keep_drop_and_minimind(think_data, tmp_path):
    kept = rendered(think_data, tmp_path, think="keep")
    assert all(EMPTY_THINK in text for text in kept) and len(kept) == ROWS
    assert not any(EMPTY_THINK in text for text in rendered(think_data, tmp_path, think="drop"))
    minimind = rendered(think_data, tmp_path, think="minimind")
    share = sum(EMPTY_THINK in text for text in minimind) / ROWS
    assert 0.12 <= share <= 0.28, share  # MiniMind keeps the block in 20% of conversations
    assert rendered(think_data, tmp_path / "again", think="minimind") == minimind  # seeded: a rebuild, a resume
    assert rendered(think_data, tmp_path, think="minimind", seed=1) != minimind  # data.seed draws


def test_system_prompts_from_a_list(think_data, tmp_path):
    prompts = ["You are a helpful AI assistant.", "You are minimind, a small but useful language model."]
    texts = rendered(think_data, tmp_path, system_prompts=prompts, system_ratio=0.5)
    with_system = [t for t in texts if "<|im_start|>system\n" in t]
    assert 0.35 <= len(with_system) / ROWS <= 0.65
    assert {next(p for p in prompts if p in t) for t in with_system} == set(prompts)
    assert not any("system" in t for t in rendered(think_data, tmp_path, system_prompts=prompts, system_ratio=0.0))


def test_a_conversation_with_a_system_message_and_dpo_pairs_get_no_system_prompt():
    rules = ChatRules("keep", ("p",), 1.0, 0)
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "u"}]
    assert rules.conversation(1, own) == own
    chosen, rejected = rules.prepare(1, ([{"role": "user", "content": "u"}], [{"role": "user", "content": "u"}]))
    assert chosen[0]["role"] == rejected[0]["role"] == "user"
    sides = [ChatRules("minimind", (), 0.2, 0).prepare(row, ([], [])) for row in range(200)]
    assert any(c.drop_think != r.drop_think for c, r in sides)  # each DPO side draws its own, as MiniMind's


@pytest.mark.parametrize("overrides, expected", [
    ([], "packed"), (["train.task=sft"], "chat"), (["train.task=dpo"], "chat"), (["train.task=distill"], "chat"),
    (["data=jsonl"], "padded"),
    (["data=jsonl", "train.task=sft"], "chat"), (["train.task=sft", "data.format=chat_packed"], "chat_packed")])
def test_data_format_follows_the_task_unless_set(overrides, expected):
    assert run_data_spec(compose_config(overrides)).format == expected


def test_the_rules_change_the_cache_key_only_when_used(think_data, tmp_path):
    from training.data.build import source_folder

    tokenizer_dir, path = think_data
    base = dict(name="jsonl", path=str(path), tokenizer=str(tokenizer_dir), format="chat", cache_dir=str(tmp_path))
    tokenizer = build_tokenizer(spec(**base))
    keep = source_folder(spec(**base), "data.path", tokenizer)
    assert source_folder(spec(**base, think="keep", system_ratio=0.5), "data.path", tokenizer) == keep
    assert source_folder(spec(**base, think="minimind"), "data.path", tokenizer) != keep
