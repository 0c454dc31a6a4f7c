"""The helper scripts: export a dense .pth to a transformers folder, then generate from it; bad input is one line."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minimind import MiniMindForCausalLM
from tests.conftest import ROOT
from tests.equivalence import compose_run_config
from training.config import model_config
from training.data import synthetic_corpus, train_bpe_tokenizer


def script(name: str):
    """scripts/<name>.py as a module (its main(argv) returns the exit code)."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, dict]:
    """A tiny model's dense .pth exported (by the script, as a user runs it) to a folder with its tokenizer."""
    root = tmp_path_factory.mktemp("export")
    cfg = compose_run_config(["model=tiny"], root / "cache")
    torch.manual_seed(0)
    model = MiniMindForCausalLM(model_config(cfg))
    torch.save(model.state_dict(), root / "pretrain_64.pth")
    train_bpe_tokenizer(synthetic_corpus(100, seed=0), vocab_size=300).save_pretrained(root / "tokenizer")
    export = subprocess.run([sys.executable, "scripts/export_hf.py", str(root / "pretrain_64.pth"),
                             str(root / "hf"), "--tokenizer", str(root / "tokenizer"), "model=tiny"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr[-2000:]
    return root, model.state_dict()


def test_export_then_generate(exported):
    root, state = exported
    loaded = MiniMindForCausalLM.from_pretrained(root / "hf")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "hf")  # the chat template travels with the export
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"
    generate = subprocess.run([sys.executable, "scripts/generate.py", str(root / "hf"), "the cat",
                               "--max-new-tokens", "5"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)  # no question to answer (custom code is trusted by flag)
    assert generate.returncode == 0, generate.stderr[-2000:]
    assert generate.stdout.strip()


def test_generate_chat_sends_a_user_turn_with_the_assistant_opening(exported, capsys):
    root, _ = exported
    from transformers import AutoTokenizer

    generate = script("generate")
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    ids = generate.prompt_ids(tokenizer, "hi", True, str(root / "hf"))
    assert tokenizer.decode(ids[0]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # as SFT data
    assert generate.main([str(root / "hf"), "what is 2+3?", "--chat", "--max-new-tokens", "3"]) == 0
    tokenizer.chat_template = None
    with pytest.raises(generate.InputError, match="has no chat template; drop --chat"):
        generate.prompt_ids(tokenizer, "hi", True, str(root / "hf"))


def one_line_failure(module, argv: list[str], capsys) -> str:
    """Run a script's main; it must exit 2 with one line on stderr, which is returned."""
    capsys.readouterr()
    assert module.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("args, expected", [
    (["--max-new-tokens", "0"], "--max-new-tokens=0 must be at least 1"),
    (["--max-new-tokens", "-3"], "--max-new-tokens=-3 must be at least 1"),
    (["--temperature", "-1"], "--temperature=-1.0 must be >= 0"),
    (["--max-new-tokens", "400"], "over the model's context of"),
    (["--long-prompt"], "over the model's context of"),
])
def test_generate_refuses_bad_input_in_one_line(exported, args, expected, capsys):
    root, _ = exported
    prompt = "the cat " * 300 if args == ["--long-prompt"] else "the cat"
    argv = [str(root / "hf"), prompt, *(a for a in args if a != "--long-prompt")]
    assert expected in one_line_failure(script("generate"), argv, capsys)


def test_generate_refuses_a_folder_that_is_not_a_model(tmp_path, capsys):
    line = one_line_failure(script("generate"), [str(tmp_path / "missing"), "hi"], capsys)
    assert "is not an exported model folder (no config.json)" in line


def test_export_refuses_a_used_output_unless_forced(exported, tmp_path, capsys):
    root, _ = exported
    export = script("export_hf")
    source = [str(root / "pretrain_64.pth")]
    (tmp_path / "file").write_text("x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    cases = [([str(tmp_path / "missing.pth"), str(tmp_path / "a")], "does not exist"),
             ([*source, str(tmp_path / "file"), "model=tiny"], "is a file, not a folder"),
             ([*source, str(tmp_path / "file" / "hf"), "model=tiny"], "cannot be created"),
             ([*source, str(tmp_path / "used"), "model=tiny"], "already holds files; choose a new one or pass --force"),
             ([*source, str(tmp_path / "file"), "--format", "pth", "model=tiny"], "exists; choose a new file or pass "
              "--force"),
             ([*source, str(tmp_path / "used"), "--format", "pth", "model=tiny"], "is a folder; give a file name")]
    for argv, expected in cases:
        assert expected in one_line_failure(export, argv, capsys), argv
    assert (tmp_path / "file").read_text() == "x"
    assert export.main([*source, str(tmp_path / "used"), "--force", "model=tiny"]) == 0
    # --force replaces the folder as a whole (a new folder renamed into place), never editing files in place
    assert not (tmp_path / "used" / "notes.txt").exists() and (tmp_path / "used" / "config.json").exists()
