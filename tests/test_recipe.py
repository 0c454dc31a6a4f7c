"""docs/recipe.md runs: its commands, in order, with a scratch folder for `runs/recipe` and a few steps each
(pretrain -> SFT -> LoRA on a pipeline -> DPO -> export -> generate -> distillation); each step starts from the
previous export, the final model answers a chat prompt, and a student distilled from the SFT export ends nearer the
teacher's distribution than a CE-only student at the same steps.

The one-process train.py lines run through train.py's entry point in this process (`training.launch.cli.main`: the
pre-launch check, then Hydra, which writes the run's `.hydra/config.yaml` and train.log, then the launch), which saves
a Python start-up of seconds each; the LoRA line runs as the reader runs it, a `python train.py` subprocess launching
its two pipeline workers. export_hf.py and generate.py run in this process through their `main(argv)` with the
page's arguments.
"""

import importlib.util
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.test_config_errors import train_py_here

PAGE = ROOT / "docs" / "recipe.md"
RUN_ROOT = "runs/recipe"
# What the test changes in the page's train.py lines: a few steps at the full learning rate at once, every step
# logged, a smaller embedded corpus (one value for every step, so one tokenizer), the worker's shared data cache.
SMALL = {"train.steps": None, "train.log_every": "1", "optim.warmup_steps": "1", "data.num_docs": "400",
         "logger": "none"}
STEPS = {"pretrain": "8", "sft": "4", "lora": "2", "dpo": "2", "distill": "4", "distill-ce": "4",
         "grpo": "2"}  # by run directory
CHAIN = ["pretrain", "sft", "lora", "dpo"]  # each starts from the export of the one before
STUDENTS = ["distill", "distill-ce"]  # distill.alpha 0.5 and 1 (CE only): the teacher is SFT's export for both
pytestmark = pytest.mark.timeout(600)  # 12 commands, three of them launching their workers; slow under a loaded CPU


def page_commands() -> list[list[str]]:
    """The argv of every command in the page's bash blocks, in page order (comments dropped)."""
    commands, inside = [], False
    for line in PAGE.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside and line.strip():
            commands.append(shlex.split(line.split("  #")[0]))
    return commands


def localised(words: list[str], root: Path) -> list[str]:
    """A command with `runs/recipe` moved to `root`."""
    return [word.replace(RUN_ROOT, str(root)) for word in words]


def with_overrides(words: list[str], overrides: dict[str, str]) -> list[str]:
    """The train.py command with `overrides` replacing the same keys' values, or appended."""
    kept = [w for w in words if w.split("=", 1)[0] not in overrides]
    return kept + [f"{key}={value}" for key, value in overrides.items()]


def script(name: str):
    """scripts/<name>.py as a module (its main(argv) returns the exit code)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def override(words: list[str], key: str) -> str | None:
    return next((w.split("=", 1)[1] for w in words if w.startswith(f"{key}=")), None)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_page_chains_pretrain_sft_lora_dpo_export_generate_distill():
    """Each train.py step of the chain loads the export of the step before; the last export is what generate.py reads;
    the two students learn from the SFT export, alike but for distill.alpha."""
    commands = page_commands()
    assert all(words[0] == ".venv/bin/python" for words in commands)
    scripts = [Path(words[1]).name for words in commands]
    assert scripts == ["train.py", "export_hf.py", "train.py", "export_hf.py", "train.py", "export_hf.py",
                       "export_hf.py", "train.py", "export_hf.py", "generate.py", "train.py", "train.py", "train.py"]
    trains = [words for words in commands if words[1] == "train.py"]
    runs = [override(words, "hydra.run.dir") for words in trains]
    assert runs == [f"{RUN_ROOT}/{name}" for name in STEPS]
    exports = {words[2]: words[3] for words in commands if words[1].endswith("export_hf.py") and len(words) == 4}
    chain = trains[:len(CHAIN)]
    assert [override(words, "checkpoint.load_dense") for words in chain] == [None, *(exports[r] for r in runs[:3])]
    generate = commands[scripts.index("generate.py")]
    assert generate[2] == exports[runs[3]] and "--chat" in generate
    assert "parallel.pp=2" in trains[2] and "lora=minimind" in trains[2]
    distill, plain, grpo = trains[len(CHAIN):]
    assert override(grpo, "checkpoint.load_dense") == exports[f"{RUN_ROOT}/dpo"] and "experiment=grpo" in grpo
    assert override(distill, "distill.teacher") == override(plain, "distill.teacher") == exports[f"{RUN_ROOT}/sft"]
    assert override(distill, "distill.alpha") is None and override(plain, "distill.alpha") == "1"  # 0.5 against CE
    alike = [[w for w in words if not w.startswith(("hydra.", "distill.alpha"))] for words in (distill, plain)]
    assert alike[0] == alike[1]  # the same student, data and seed


def test_the_recipe_runs_and_its_final_model_answers_a_chat_prompt(tmp_path, data_cache, capsys,
                                                                    monkeypatch):
    root = tmp_path / "recipe"
    export, generate = script("export_hf"), script("generate")
    answer = None
    for words in page_commands():
        words = localised(words, root)
        if words[1] == "train.py":
            name = Path(override(words, "hydra.run.dir")).name
            argv = with_overrides(words[1:], {**SMALL, "train.steps": STEPS[name], "data.cache_dir": str(data_cache)})
            if "parallel.pp=2" in argv:  # the reader's self-launch of two workers, from a process of its own
                result = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                                        timeout=240, stdin=subprocess.DEVNULL)
                assert result.returncode == 0, f"{' '.join(words)}\n{result.stderr[-3000:]}"
            else:
                result = train_py_here(argv[1:], monkeypatch, capsys)
                assert result.returncode == 0, f"{' '.join(words)}\n{result.stderr[-3000:]}"
            assert [r["step"] for r in metrics(root / name)] == list(range(1, int(STEPS[name]) + 1)), name
        elif words[1].endswith("export_hf.py"):
            assert export.main(words[2:]) == 0, words
            assert (Path(words[3]) / ("adapter_config.json" if "--adapters-only" in words else "config.json")).is_file()
        else:
            capsys.readouterr()
            assert generate.main(words[2:]) == 0, words
            answer = capsys.readouterr().out.strip()

    first = {name: metrics(root / name)[0] for name in STEPS}
    assert metrics(root / "pretrain")[-1]["loss"] < first["pretrain"]["loss"] - 1.0  # it learns
    # SFT starts from the pretrained export: far below a fresh model's uniform guess (ln 2048 = 7.62, see pretrain).
    assert abs(first["pretrain"]["loss"] - math.log(2048)) < 0.3
    assert first["sft"]["loss"] < first["pretrain"]["loss"] - 1.0
    # LoRA's step 1 reads SFT's first batch (same data, seed and geometry) with SFT's trained weights (adapters at 0).
    assert first["lora"]["tokens"] == first["sft"]["tokens"]
    assert first["lora"]["loss"] < first["sft"]["loss"] - 0.1
    assert first["dpo"]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as its reference
    for previous, name in [("pretrain-hf", "sft"), ("sft-hf", "lora"), ("lora-hf", "dpo")]:
        saved = yaml.safe_load((root / name / ".hydra" / "config.yaml").read_text())
        assert saved["checkpoint"]["load_dense"] == str(root / previous), name
    students = {name: metrics(root / name) for name in STUDENTS}
    for name in STUDENTS:  # the teacher was the SFT export
        saved = yaml.safe_load((root / name / ".hydra" / "config.yaml").read_text())
        assert saved["distill"]["teacher"] == str(root / "sft-hf") and saved["train"]["task"] == "distill", name
    # The same seed, data and student: step 1 (before any update) is one number in both runs, CE and KL alike.
    assert {k: students["distill"][0][k] for k in ("ce_loss", "distill_loss", "tokens")} == \
        {k: students["distill-ce"][0][k] for k in ("ce_loss", "distill_loss", "tokens")}
    assert students["distill-ce"][-1]["loss"] == pytest.approx(students["distill-ce"][-1]["ce_loss"])  # alpha=1
    # The acceptance: at the same steps the distilled student is nearer the teacher's distribution (its T^2-scaled
    # KL, distill_loss) than the CE-only one, by far more than noise (measured: 0.26 against 0.35, mean of steps 3-4).
    last = {name: sum(row["distill_loss"] for row in rows[-2:]) / 2 for name, rows in students.items()}
    assert last["distill"] < 0.85 * last["distill-ce"], last
    adapters = json.loads((root / "lora-adapters" / "adapter_config.json").read_text())
    assert adapters["base_model_name_or_path"] == str(root / "sft-hf") and adapters["r"] == 16  # lora=minimind: MiniMind's rank
    assert (root / "final" / "model.safetensors").is_file()
    grpo = metrics(root / "grpo")  # step 8 from the final model: rollouts, rule rewards, CISPO (its rise: test_grpo_demo)
    assert all({"reward_mean", "kl_ref", "completion_len", "rollout_tokens_per_s"} <= set(row) for row in grpo)
    assert grpo[0]["kl_ref"] == 0.0  # step 1's policy is its reference
    assert answer, "generate.py --chat printed no answer"
