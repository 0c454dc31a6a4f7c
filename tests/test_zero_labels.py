"""Zero-label data everywhere (issue 35, item 6) and the data cases of item 9.

A held-out split and each side of DPO pairs get the check SFT training data has: refused when most of their samples
(all of them, before launch, from the first rows) hold no label token within train.seq_len, warned with the share
and the cause otherwise. A lone surrogate in a JSONL line, a chat template that raises and a `save_to_disk` folder
whose state.json is not what `save_to_disk` writes are one line each, naming the file (and line) and the fix."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from tests.data_helpers import SMALL, data_section, make_cfg, spec
from tests.equivalence import compose_run_config
from training.data import DataError, build_data, build_tokenizer, build_val_batches, data_problem

ANSWER = [{"role": "user", "content": "count from 3."}, {"role": "assistant", "content": "counting: 3 4 5 6 7."}]
LONG_SYSTEM = {"role": "system", "content": " ".join(["you are a careful robot who answers in one line."] * 12)}
CUT = [LONG_SYSTEM, {"role": "user", "content": "and 3 times 4?"}, {"role": "assistant", "content": "12."}]
FIX = "raise train.seq_len or use shorter conversations"
SEQ = 64  # CUT's assistant tokens all lie beyond it; ANSWER's within


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(spec(**SMALL, cache_dir=str(tmp_path_factory.mktemp("cache")))).save_pretrained(folder)
    return folder


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def chats(path: Path, conversations: list[list[dict]]) -> Path:
    return jsonl(path, [{"conversations": c} for c in conversations])


def pairs(path: Path, chosen: list[list[dict]], rejected: list[list[dict]]) -> Path:
    return jsonl(path, [{"chosen": c, "rejected": r} for c, r in zip(chosen, rejected)])


def cfg_of(tmp_path: Path, tokenizer, path: Path, val_path: Path | None = None, dpo: bool = False, **data):
    section = data_section(name="jsonl", path=str(path), tokenizer=str(tokenizer), format="chat",
                           val_path=None if val_path is None else str(val_path), cache_dir=str(tmp_path / "cache"),
                           **data)
    cfg = make_cfg(section, seq_len=SEQ)
    cfg.train.task = "dpo" if dpo else "sft"
    return cfg


def refusal(key: str, what: str, checked: int, held_out: bool = False) -> str:
    effect = "validation would measure nothing on them" if held_out else "they would train on nothing"
    return (f"{key}: in 100% of the {what} ({checked} checked) every assistant token lies beyond train.seq_len={SEQ}, "
            f"so {effect}; {FIX}")


def build_error(cfg, val: bool = False) -> str:
    with pytest.raises(DataError) as error:
        build_val_batches(cfg, 0, 1, 1) if val else build_data(cfg, 0, 1, verbose=False)
    return str(error.value)


def warnings_of(cfg, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sluice"):
        build_data(cfg, 0, 1, verbose=True)
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_held_out_file_without_labels_is_refused_before_launch(tmp_path, tokenizer_dir, capsys):
    """Was: val_loss 0.0000, val_ppl 1.0. Now `train.py` exits 2 with one line before any worker starts."""
    from training.launch.workers import run

    train, val = chats(tmp_path / "sft.jsonl", [ANSWER] * 16), chats(tmp_path / "val.jsonl", [CUT] * 8)
    expected = refusal("data.val_path", "chat samples", 8, held_out=True)
    assert data_problem(cfg_of(tmp_path, tokenizer_dir, train, val)) == expected
    assert build_error(cfg_of(tmp_path, tokenizer_dir, train, val), val=True) == expected  # the worker's own check
    cfg = compose_run_config(["model=tiny", "train.task=sft", "data=jsonl", f"data.path={train}",
                              f"data.val_path={val}", f"data.tokenizer={tokenizer_dir}", "data.format=chat",
                              f"train.seq_len={SEQ}", "train.eval_every=1"], tmp_path / "cache")
    with pytest.raises(SystemExit) as leaving:
        run(cfg, tmp_path / "run")
    assert leaving.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"sluice: config error: {expected}"]


def test_a_partly_unlabeled_held_out_split_is_warned_with_its_share(tmp_path, tokenizer_dir, caplog):
    train, val = chats(tmp_path / "sft.jsonl", [ANSWER] * 16), chats(tmp_path / "val.jsonl", [CUT, *[ANSWER] * 3] * 2)
    cfg = cfg_of(tmp_path, tokenizer_dir, train, val)
    assert data_problem(cfg) is None
    assert warnings_of(cfg, caplog) == [
        f"data.val_path: in 25% of the chat samples (8 checked) every assistant token lies beyond train.seq_len={SEQ}; "
        f"validation would measure nothing on them ({FIX})"]
    assert len(build_val_batches(cfg, 0, 1, 2)) == 2  # it still evaluates


def test_a_held_out_fraction_is_checked_as_its_own_split():
    """data.val_fraction draws the held-out rows from data.path: the worker checks that split as drawn."""
    import torch

    from training.data import IGNORE_INDEX, TensorSamples
    from training.data.build import Splits, unlabeled_findings

    ids = torch.ones(4, 8, dtype=torch.long)
    train, val = TensorSamples(ids, ids), TensorSamples(ids, torch.full_like(ids, IGNORE_INDEX))
    found = unlabeled_findings(spec(format="chat", val_fraction=0.2), Splits(train, val, 0))
    assert [(f.key, f.held_out, f.share, f.refused) for f in found] == [
        ("data.path", False, 0.0, False), ("data.val_fraction", True, 1.0, True)]


def test_dpo_pairs_whose_chosen_side_is_all_beyond_seq_len_are_refused(tmp_path, tokenizer_dir):
    """Was: trained with reward_chosen 0.0 and no warning (the rows' share was 50%, not above it)."""
    path = pairs(tmp_path / "dpo.jsonl", [CUT] * 20, [ANSWER] * 20)
    cfg = cfg_of(tmp_path, tokenizer_dir, path, dpo=True)
    expected = refusal("data.path", "chosen conversations", 20)
    assert data_problem(cfg) == expected  # before launch
    assert build_error(cfg) == expected  # in the worker


def test_dpo_pairs_whose_rejected_side_is_partly_beyond_seq_len_are_warned(tmp_path, tokenizer_dir, caplog):
    path = pairs(tmp_path / "dpo.jsonl", [ANSWER] * 20, [CUT, ANSWER, ANSWER, ANSWER] * 5)
    cfg = cfg_of(tmp_path, tokenizer_dir, path, dpo=True)
    assert data_problem(cfg) is None
    assert warnings_of(cfg, caplog) == [
        f"data.path: in 25% of the rejected conversations (20 checked) every assistant token lies beyond "
        f"train.seq_len={SEQ}; they would train on nothing ({FIX})"]


def test_a_lone_surrogate_names_the_line(tmp_path, tokenizer_dir):
    """Was: "unexpected TypeError: TextEncodeInput must be Union[...]" from the tokenizer."""
    path = tmp_path / "sft.jsonl"
    good = json.dumps({"conversations": ANSWER})
    path.write_text(f"{good}\n{good}\n" + '{"conversations": [{"role": "user", "content": "hi \\ud800"}, '
                    '{"role": "assistant", "content": "hello \\ud83d\\ude00"}]}\n' + f"{good}\n" * 8)
    cfg = cfg_of(tmp_path, tokenizer_dir, path)
    expected = (f"data.path: {path}:3: a lone surrogate \\ud800 (a JSON escape of half a UTF-16 pair: no character, "
                "so no tokenizer encodes it); fix or remove the line, or set data.skip_bad_lines=true to skip bad "
                "lines")
    assert data_problem(cfg) == expected
    assert build_error(cfg) == expected
    skipping = cfg_of(tmp_path, tokenizer_dir, path, skip_bad_lines=True)
    assert build_data(skipping, 0, 1, verbose=False)[0].skipped_lines == 1  # a surrogate pair (an emoji) is fine


def template_tokenizer(tokenizer_dir: Path, folder: Path, template: str) -> Path:
    """A copy of the test tokenizer with another chat template."""
    shutil.copytree(tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


@pytest.mark.parametrize("template, error", [
    ("{{ raise_exception('this template renders nothing') }}", "TemplateError: this template renders nothing"),
    ("{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}",
     "TemplateAssertionError: No filter named 'no_such_filter'.")], ids=["raise_exception", "jinja-error"])
def test_a_chat_template_that_raises_is_one_line(tmp_path, tokenizer_dir, template, error):
    """Was: "unexpected TemplateError" (or TemplateAssertionError) from the first batch."""
    folder = template_tokenizer(tokenizer_dir, tmp_path / "tokenizer", template)
    cfg = cfg_of(tmp_path, folder, chats(tmp_path / "sft.jsonl", [ANSWER] * 16))
    assert data_problem(cfg) == (
        f"data.tokenizer: the chat template of '{folder}' fails on a plain user/assistant conversation ({error}); "
        "fix its chat_template (tokenizer_config.json or chat_template.jinja) or use another tokenizer")
    assert build_error(cfg) == (f"data.path: {tmp_path / 'sft.jsonl'}:1: the chat template of data.tokenizer fails on "
                                f"it ({error}); fix or remove the line, or set data.skip_bad_lines=true to skip bad "
                                "lines")


def test_a_chat_template_that_refuses_some_rows_names_the_first(tmp_path, tokenizer_dir):
    """A template that raises on some conversations only (here: a system message) names the row, or skips it."""
    from training.data import CHATML_TEMPLATE

    no_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    folder = template_tokenizer(tokenizer_dir, tmp_path / "tokenizer", no_system + CHATML_TEMPLATE)
    path = chats(tmp_path / "sft.jsonl", [ANSWER] * 4 + [CUT] + [ANSWER] * 11)
    expected = (f"data.path: {path}:5: the chat template of data.tokenizer fails on it (TemplateError: System role "
                "not supported); fix or remove the line, or set data.skip_bad_lines=true to skip bad lines")
    assert data_problem(cfg_of(tmp_path, folder, path)) == expected
    assert build_error(cfg_of(tmp_path, folder, path)) == expected
    stream, _ = build_data(cfg_of(tmp_path, folder, path, skip_bad_lines=True), 0, 1, verbose=False)
    assert (stream.skipped_lines, len(stream.samples)) == (1, 15)


@pytest.mark.parametrize("state, problem", [
    ([], "is a list, not the object of fields save_to_disk writes"),
    ("rows", "is a string, not the object of fields save_to_disk writes"),
    ({"_fingerprint": "x"}, 'has no "_data_files" field'),
])
def test_a_saved_folder_whose_state_json_is_wrong_is_one_line(tmp_path, tokenizer_dir, state, problem):
    """Was: a TypeError or KeyError traceback from `datasets.load_from_disk`."""
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"conversations": [ANSWER] * 16}).save_to_disk(str(folder))
    (folder / "state.json").write_text(json.dumps(state))
    cfg = cfg_of(tmp_path, tokenizer_dir, folder)
    expected = (f"data.path: '{folder / 'state.json'}' {problem}; save the dataset again with Dataset.save_to_disk, "
                "or point at a .parquet / .arrow / .jsonl file")
    assert data_problem(cfg) == expected
    assert build_error(cfg) == expected


def test_a_saved_folder_naming_a_file_outside_it_is_refused(tmp_path, tokenizer_dir):
    import datasets

    folder, elsewhere = tmp_path / "saved", tmp_path / "elsewhere"
    datasets.Dataset.from_dict({"conversations": [ANSWER] * 16}).save_to_disk(str(folder))
    datasets.Dataset.from_dict({"conversations": [CUT] * 16}).save_to_disk(str(elsewhere))
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": f"../elsewhere/{f['filename']}"} for f in state["_data_files"]]
    (folder / "state.json").write_text(json.dumps(state))
    message = data_problem(cfg_of(tmp_path, tokenizer_dir, folder))
    assert message.startswith(f"data.path: '{folder / 'state.json'}': {folder} names '../elsewhere/"), message
    assert "a path outside that folder" in message
