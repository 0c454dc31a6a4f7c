"""The recipe's step 8 (docs/recipe.md): `experiment=grpo` on the embedded prompts with MiniMind's rule rewards raises
the mean reward of the last quarter of its steps above the first quarter's by the margin the page states.

The page starts step 8 from the recipe's final model (pretrain, SFT, LoRA, DPO: minutes); this test starts it from
a shorter pretraining and SFT of the same model, which already answers in the embedded answers' shape: short replies,
some under the rule's 20 characters, so the rewards of a group differ and GRPO learns to answer at the length the
rule rewards. The runs go through train.py's entry point in this process.
"""

import json
import re

import pytest

from tests.conftest import ROOT
from tests.test_config_errors import train_py_here
from tests.test_recipe import page_commands, script, with_overrides

pytestmark = pytest.mark.timeout(600)
# Shorter than the recipe's 200 and 100 steps, enough for answers of the embedded answers' shape.
PRETRAIN, SFT = ["train.steps=100"], ["train.task=sft", "data.format=chat", "train.steps=50", "optim.lr=1e-3",
                                      "optim.warmup_steps=5"]


def stated_margin() -> float:
    """The rise the page promises: 'by at least X' in its step 8."""
    text = (ROOT / "docs" / "recipe.md").read_text()
    section = text[text.index("## 8. GRPO"):]
    return float(re.search(r"the last quarter's mean reward is at least ([0-9.]+) above the first quarter's",
                            " ".join(section.split())).group(1))


def step8() -> list[str]:
    """The page's step 8 command (argv after the interpreter)."""
    return next(words[1:] for words in page_commands() if "experiment=grpo" in words)


def test_step_8_raises_the_rule_reward_by_the_stated_margin(tmp_path, data_cache, capsys, monkeypatch):
    start = []
    for name, overrides in (("pretrain", PRETRAIN), ("sft", SFT)):
        argv = ["experiment=demo", *overrides, *start, "logger=none", f"hydra.run.dir={tmp_path / name}",
                f"data.cache_dir={data_cache}"]
        result = train_py_here(argv, monkeypatch, capsys)
        assert result.returncode == 0, result.stderr[-3000:]
        assert script("export_hf").main([str(tmp_path / name), str(tmp_path / f"{name}-hf")]) == 0
        start = [f"checkpoint.load_dense={tmp_path / f'{name}-hf'}"]
    run = tmp_path / "grpo"
    argv = with_overrides(step8(), {"checkpoint.load_dense": str(tmp_path / "sft-hf"), "hydra.run.dir": str(run),
                                    "logger": "none", "data.cache_dir": str(data_cache)})
    result = train_py_here(argv[1:], monkeypatch, capsys)
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [json.loads(line)["reward_mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    quarter = len(rewards) // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last >= first + stated_margin(), (first, last, rewards)
    samples = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert samples and all({"prompt", "completion", "reward", "advantage"} <= set(s) for s in samples)
