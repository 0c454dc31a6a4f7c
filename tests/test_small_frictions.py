"""The small frictions of a MiniMind user (issue 48 item 8), in this process: rows of another task name the train.task
that reads them (not data.skip_bad_lines), a `checkpoint.load_dense` of another size is one line before launch (its
shapes read from the headers), scripts/generate.py takes a `.pth` and chats over several turns, and what the README's
commands write is ignored by git."""

import io
import json
import subprocess

import pytest

from parallel.grid import ParallelGrid
from tests.conftest import ROOT
from tests.equivalence import compose_run_config
from tests.test_scripts import script
from training.config import ConfigError
from training.config.schema import compose_config
from training.config.validate import validate
from training.data import data_problem
from training.data.jsonl import parse_row
from training.data.rows import TASKS

TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory):
    """A one-step run with checkpoint.export_pth=true: its out/pretrain_64.pth and the tokenizer its checkpoint keeps."""
    from training.trainer import Trainer

    root = tmp_path_factory.mktemp("stage")
    cfg = compose_run_config(["model=tiny", "train.steps=1", "checkpoint.save_final=true", "checkpoint.export_pth=true"],
                             root / "cache")
    Trainer(cfg, ParallelGrid.single("cpu"), root / "run").fit()
    return root / "run"


def test_a_row_of_another_task_names_the_train_task_that_reads_it(tmp_path):
    conversation, pair = {"conversations": TURN}, {"chosen": TURN, "rejected": TURN}
    cases = [(conversation, "text", 'no "text" key; it is a conversation ("conversations"), which train.task=sft '
                                    "trains on: set train.task=sft"),
             (pair, "chat", 'no "conversations" key; it is a DPO pair ("chosen", "rejected"), which train.task=dpo '
                            "trains on: set train.task=dpo"),
             ({"text": "a document"}, "dpo", 'no "chosen" key (a DPO row holds "chosen" and "rejected" '
                                             'conversations); it is a text ("text"), which train.task=pretrain trains '
                                             "on: set train.task=pretrain"),
             ({"text": 7}, "text", '"text" is a int, not a string')]  # a bad row of the right task: no hint
    for row, task, problem in cases:
        assert parse_row(json.dumps(row).encode(), TASKS[task]) == (None, problem)
    rows = tmp_path / "sft.jsonl"
    rows.write_text(json.dumps(conversation) + "\n")
    cfg = compose_config(["model=tiny", "data=jsonl", f"data.path={rows}", "data.tokenizer=synthetic",
                          f"data.cache_dir={tmp_path / 'cache'}"])
    assert data_problem(cfg) == (
        f'data.path: {rows}:1: no "text" key; it is a conversation ("conversations"), which train.task=sft trains on: '
        "set train.task=sft (or give a file of this task's rows)")


def test_dense_weights_of_another_size_are_one_line_before_launch(stage_run):
    pth = stage_run / "out" / "pretrain_64.pth"
    validate(compose_config(["model=tiny", f"checkpoint.load_dense={pth}"]))  # its own size: fine
    with pytest.raises(ConfigError) as refused:
        validate(compose_config(["model=tiny", "model.hidden_size=128", f"checkpoint.load_dense={pth}"]))
    assert str(refused.value).startswith(
        f"checkpoint.load_dense={pth}: model.embed_tokens.weight has shape (2048, 64), the model expects (2048, 128) "
        "(and ")


def test_generate_takes_a_pth_and_chats_over_turns(stage_run, capsys, monkeypatch):
    generate = script("generate")
    pth = str(stage_run / "out" / "pretrain_64.pth")
    args = ["--max-new-tokens", "4"]
    assert generate.main([pth, "the cat", *args]) == 0  # its tokenizer: the one the run saved with its checkpoint
    assert capsys.readouterr().out.strip()
    seen = []
    prompt_ids = generate.prompt_ids
    monkeypatch.setattr(generate, "prompt_ids", lambda *a: seen.append([m["role"] for m in a[4]]) or prompt_ids(*a))
    monkeypatch.setattr("sys.stdin", io.StringIO("and the dog?\nthanks\n\nnever read\n"))
    assert generate.main([pth, "the cat", "--interactive", *args]) == 0
    capsys.readouterr()
    # three turns up to the empty line, each rendered after the conversation so far
    assert seen == [[], ["user", "assistant"], ["user", "assistant", "user", "assistant"]]
    assert generate.main([str(stage_run), "--interactive"]) == 2
    assert "--interactive chats with an exported folder or a .pth" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["runs/recipe/pretrain/metrics.jsonl", "runs/recipe/pretrain/out/pretrain_128.pth",
                                  "out/full_sft_512.pth", "outputs/2026-12-06/10-00-00/train.log", "multirun/x/0/a"])
def test_what_the_readme_commands_write_is_ignored_by_git(path):
    """The run folders and stage weights of the README's and the recipe's commands never show as untracked files."""
    assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
