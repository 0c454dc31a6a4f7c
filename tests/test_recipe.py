"""docs/recipe.md runs as written: its commands, in order, with a scratch folder for `runs/recipe` (pretrain -> SFT
-> LoRA on a pipeline -> DPO, each from the `.pth` the stage before wrote, no export between them -> export ->
generate -> distillation -> GRPO); every figure the page marks equals what the runs logged, to the printed digits
(scripts/recipe_figures.py), the distilled student ends nearer the teacher than a CE-only one, and GRPO raises the
rule reward by the margin the page states.

The one-process train.py lines run through train.py's entry point in this process (`training.launch.cli.main`: the
pre-launch check, then Hydra, which writes the run's `.hydra/config.yaml` and train.log, then the launch), which saves
a Python start-up of seconds each; the LoRA line runs as the reader runs it, a `python train.py` subprocess launching
its two pipeline workers. export_hf.py and generate.py run in this process through their `main(argv)` with the
page's arguments. The page's own step counts are what run (100 pretraining steps, 50 of SFT, a few of the rest): the
figures are the reader's, and this test replaces tests/test_grpo_demo.py's separate pretraining and SFT.
"""

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_config_errors import train_py_here

PAGE = ROOT / "docs" / "recipe.md"
RUN_ROOT = "runs/recipe"
RUNS = ["pretrain", "sft", "lora", "dpo", "distill", "distill-ce", "grpo"]  # by run directory, in page order
CHAIN = ["pretrain", "sft", "lora", "dpo"]  # each starts from the stage weights of the one before
STAGE_FILE = {"pretrain": "pretrain_128.pth", "sft": "full_sft_128.pth", "lora": "full_sft_128.pth",
              "dpo": "dpo_128.pth"}  # MiniMind's names: <stage>_<hidden>.pth
STUDENTS = ["distill", "distill-ce"]  # distill.alpha 0.5 and 1 (CE only): the teacher is SFT's stage weights
pytestmark = pytest.mark.timeout(900)  # 11 commands at the page's lengths, one launching its workers


def script(name: str):
    """scripts/<name>.py as a module (its main(argv) returns the exit code)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIGURES = script("recipe_figures")
page_commands = FIGURES.page_commands


def localised(words: list[str], root: Path) -> list[str]:
    """A command with `runs/recipe` moved to `root`."""
    return [word.replace(RUN_ROOT, str(root)) for word in words]


def with_overrides(words: list[str], overrides: dict[str, str]) -> list[str]:
    """The train.py command with `overrides` replacing the same keys' values, or appended."""
    kept = [w for w in words if w.split("=", 1)[0] not in overrides]
    return kept + [f"{key}={value}" for key, value in overrides.items()]


def override(words: list[str], key: str) -> str | None:
    return next((w.split("=", 1)[1] for w in words if w.startswith(f"{key}=")), None)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_page_chains_its_stages_through_the_pth_files_they_write():
    """Pretrain -> SFT -> LoRA -> DPO, each `checkpoint.load_dense` the `.pth` the stage before wrote (no export
    between stages, issue 48 acceptance 3); the one export is DPO's, which generate.py reads; the students learn from
    SFT's stage weights, alike but for distill.alpha; GRPO starts from DPO's."""
    commands = page_commands()
    assert all(words[0] == ".venv/bin/python" for words in commands)
    scripts = [Path(words[1]).name for words in commands]
    assert scripts == ["train.py", "train.py", "train.py", "export_hf.py", "train.py", "export_hf.py", "generate.py",
                       "train.py", "train.py", "train.py"]
    trains = [words for words in commands if words[1] == "train.py"]
    assert [override(words, "hydra.run.dir") for words in trains] == [f"{RUN_ROOT}/{name}" for name in RUNS]
    chain = trains[:len(CHAIN)]
    stage_files = [f"{RUN_ROOT}/{name}/out/{STAGE_FILE[name]}" for name in CHAIN]
    assert [override(words, "checkpoint.load_dense") for words in chain] == [None, *stage_files[:-1]]
    assert all(override(words, "checkpoint.export_pth") == "true" for words in chain)
    final = next(words for words in commands if words[1].endswith("export_hf.py") and "--adapters-only" not in words)
    assert final[2] == f"{RUN_ROOT}/dpo"
    generate = commands[scripts.index("generate.py")]
    assert generate[2] == final[3] and "--chat" in generate
    assert "parallel.pp=2" in trains[2] and "lora=minimind" in trains[2]
    distill, plain, grpo = trains[len(CHAIN):]
    assert override(grpo, "checkpoint.load_dense") == stage_files[-1] and "experiment=grpo" in grpo
    assert override(distill, "distill.teacher") == override(plain, "distill.teacher") == stage_files[1]
    assert override(distill, "distill.alpha") is None and override(plain, "distill.alpha") == "1"  # 0.5 against CE
    alike = [[w for w in words if not w.startswith(("hydra.", "distill.alpha"))] for words in (distill, plain)]
    assert alike[0] == alike[1]  # the same student, data and seed


def run_the_page(root: Path, data_cache: Path, capsys, monkeypatch) -> str:
    """Every command of the page in order, `runs/recipe` at `root`; what generate.py printed."""
    export, generate = script("export_hf"), script("generate")
    answer = ""
    for words in page_commands():
        words = localised(words, root)
        if words[1] == "train.py":  # as written, but for the worker-shared data cache and no logger beyond the files
            argv = with_overrides(words[1:], {"data.cache_dir": str(data_cache), "logger": "none"})
            if "parallel.pp=2" in argv:  # the reader's self-launch of two workers, from a process of its own
                result = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                                        timeout=300, stdin=subprocess.DEVNULL)
            else:
                result = train_py_here(argv[1:], monkeypatch, capsys)
            assert result.returncode == 0, f"{' '.join(words)}\n{result.stderr[-3000:]}"
        elif words[1].endswith("export_hf.py"):
            assert export.main(words[2:]) == 0, words
        else:
            capsys.readouterr()
            assert generate.main(words[2:]) == 0, words
            answer = capsys.readouterr().out.strip()
    return answer


def test_the_recipe_runs_as_written_and_every_figure_on_the_page_is_measured(tmp_path, data_cache, capsys,
                                                                               monkeypatch):
    root = tmp_path / "recipe"
    answer = run_the_page(root, data_cache, capsys, monkeypatch)
    text = PAGE.read_text()
    wrong = FIGURES.differences(text, FIGURES.measured(text, root, answer))
    assert not wrong, ("docs/recipe.md's figures differ from this run's: " + "; ".join(wrong) +
                       f" (if the change that moved them is meant: python scripts/recipe_figures.py {root} --write)")

    for name in CHAIN:  # MiniMind's stage weights, written by each stage for the next
        assert (root / name / "out" / STAGE_FILE[name]).is_file(), name
    first = {name: metrics(root / name)[0] for name in RUNS}
    assert abs(first["pretrain"]["loss"] - math.log(2048)) < 0.3  # the uniform guess over the vocabulary
    assert first["sft"]["loss"] < first["pretrain"]["loss"] - 1.0  # SFT starts from the pretrained weights
    # LoRA's step 1 reads SFT's first batch (same data, seed and geometry) with SFT's trained weights (adapters at 0).
    assert first["lora"]["tokens"] == first["sft"]["tokens"]
    assert first["lora"]["loss"] < first["sft"]["loss"] - 1.0
    assert first["dpo"]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as its reference
    students = {name: metrics(root / name) for name in STUDENTS}
    # The same seed, data and student: step 1 (before any update) is one number in both runs, CE and KL alike.
    assert {k: students["distill"][0][k] for k in ("ce_loss", "distill_loss")} == \
        {k: students["distill-ce"][0][k] for k in ("ce_loss", "distill_loss")}
    assert students["distill-ce"][-1]["loss"] == pytest.approx(students["distill-ce"][-1]["ce_loss"])  # alpha=1
    # The distillation acceptance: at the same steps the distilled student is nearer the teacher (its T^2-scaled KL).
    assert students["distill"][-1]["distill_loss"] < 0.95 * students["distill-ce"][-1]["distill_loss"]
    adapters = json.loads((root / "lora-adapters" / "adapter_config.json").read_text())
    assert adapters["r"] == 16  # lora=minimind: MiniMind's rank
    assert (root / "final" / "model.safetensors").is_file()
    grpo = metrics(root / "grpo")  # rollouts, rule rewards, CISPO from DPO's stage weights
    assert grpo[0]["kl_ref"] == 0.0  # step 1's policy is its reference
    rise = FIGURES.metric(root, "grpo:reward_mean@q4") - FIGURES.metric(root, "grpo:reward_mean@q1")
    assert rise >= stated_margin(text), [r["reward_mean"] for r in grpo]
    samples = [json.loads(line) for line in (root / "grpo" / "rollouts.jsonl").read_text().splitlines()]
    assert samples and all({"prompt", "completion", "reward", "advantage"} <= set(s) for s in samples)
    assert answer, "generate.py --chat printed no answer"


def stated_margin(text: str) -> float:
    """The rise of GRPO's mean reward the page promises: 'at least X above' in its step 8."""
    section = " ".join(text[text.index("## 8. GRPO"):].split())
    return float(re.search(r"the last quarter's mean reward is at least ([0-9.]+) above the first quarter's",
                           section).group(1))
