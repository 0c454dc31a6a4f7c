"""Every training command in README.md and docs/ composes and validates: the docs cannot drift from the config.

Each `train.py` line of a code block (python, torchrun or sbatch) is split into its jobs as `python train.py` would
split a sweep, composed by Hydra and validated before launch with the world size its launcher gives. Paths the docs
name as placeholders (`pretrain_768.pth`, `path/to/hf_folder`) are made in a scratch folder: a transformers
config.json folder where a model config is expected, an empty file elsewhere; the data and checkpoint files
themselves are validated by their own tests, so a command naming a placeholder skips only those two checks.
"""

import importlib
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT
from training.launch.cli import expand_jobs, split_argv
from training.config.validate import validate
from training.config.schema import compose_config

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"(path/to/\S+|runs/\S+|\S+\.(?:pth|jsonl|safetensors))$")  # files the reader has
COMMAND = re.compile(r"(\S*/)?(python|torchrun|sbatch)\s")
HF_CONFIG = ROOT / "models" / "configs" / "llama-tiny"
validation = importlib.import_module("training.config.validate")  # the module (its function has its name)


def code_lines(page: Path) -> list[str]:
    """The shell lines of a page's fenced code blocks, continuations joined and comments dropped."""
    lines, inside, pending = [], False, ""
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        line = pending + line.split("  #")[0].strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        lines.append(line)
    return lines


def train_commands() -> list[tuple[str, str]]:
    """(page: line, command) for every documented command that runs train.py."""
    found = []
    for page in PAGES:
        for line in code_lines(page):
            if COMMAND.match(line) and re.search(r"\strain\.(py|sbatch)(\s|$)", line):
                found.append((f"{page.name}: {line[:60]}", line))
    return found


def world_size_of(words: list[str]) -> int | None:
    """The world a launcher gives: torchrun's processes per node; None where train.py decides (or Slurm does)."""
    for i, word in enumerate(words):
        if word.startswith(("--nproc-per-node", "--nproc_per_node")):
            return int(word.split("=")[1] if "=" in word else words[i + 1])
    return None


def overrides_of(words: list[str]) -> list[str]:
    """What follows train.py (or the sbatch script): Hydra's flags and the overrides."""
    start = next(i for i, w in enumerate(words) if w.endswith(("train.py", "train.sbatch")))
    return words[start + 1:]


def test_the_docs_have_many_train_commands():
    assert len(train_commands()) >= 20


@pytest.mark.parametrize("where,line", train_commands(), ids=[where for where, _ in train_commands()])
def test_a_documented_command_composes_and_validates(where, line, tmp_path, monkeypatch, capsys):
    words = shlex.split(line)
    flags, overrides = split_argv(overrides_of(words))
    placeholders = False
    for override in overrides:
        key, _, value = override.partition("=")
        if PLACEHOLDER.match(value) and not Path(value).exists():
            placeholders = True
            target = tmp_path / value
            if key == "model.hf_config" or value.endswith(("hf_folder", "_tokenizer")):
                shutil.copytree(HF_CONFIG, target, dirs_exist_ok=True)
            elif Path(value).suffix:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()
            else:
                target.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp_path)
    if placeholders:  # the files are stand-ins: their contents are other tests' business
        monkeypatch.setattr(validation, "data_tokenizer_problem", lambda *args: None)
        monkeypatch.setattr(validation, "checkpoint_problem", lambda *args: None)
    jobs = list(expand_jobs(overrides))
    assert jobs, where
    for job in jobs:
        validate(compose_config(job), world_size_of(words))
    assert "-m" in flags or len(jobs) == 1


def test_the_folders_the_documented_commands_write_are_ignored_by_git():
    """A run directory (`hydra.run.dir=runs/...`) or an export (`out/...`) the docs' commands make is not offered to
    `git add`: README's quick start writes both inside the checkout."""
    import subprocess

    written = {m.group(1).split("/")[0] for page in PAGES for line in code_lines(page)
               for m in re.finditer(r"(?:hydra\.run\.dir=|export_hf\.py \S+ )((?:runs|out)/\S+)", line)}
    assert written == {"runs", "out"}, written
    for folder in sorted(written):
        checked = subprocess.run(["git", "check-ignore", "-q", f"{folder}/any-run"], cwd=ROOT)
        assert checked.returncode == 0, f"{folder}/ is not in .gitignore"
