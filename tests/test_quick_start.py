"""README's quick start and docs/checkpoints.md's "Continue training" run in page order: train the demo, continue it
into a new run directory with a larger total, continue the same run directory with `resume=auto` (what one does after a
crash), export, generate. Issue 38 found the continue command exiting 2 (its model was not the demo's); composing it
(tests/test_documented_commands.py) cannot see that, running it does.

Each train.py line runs in this process as train.py runs a one-process job: its pre-launch check (`preflight`, where
the continue command failed), then the Trainer on the config its overrides compose, in its `hydra.run.dir`; with a
few steps (the page's totals scaled down, their order kept). export_hf.py and generate.py run through their
`main(argv)` with the page's arguments.
"""

import json
import shlex
from pathlib import Path

import torch

from parallel.grid import ParallelGrid
from tests.conftest import ROOT
from tests.test_recipe import script
from training.launch.cli import preflight
from training.config.schema import compose_config
from training.trainer import Trainer


def block_after(page: Path, heading: str) -> list[list[str]]:
    """The argv of each command in the first code block after `heading` (comments dropped)."""
    text = page.read_text().split(heading, 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line.split("  #")[0]) for line in block.splitlines() if line.strip()]


def localised(words: list[str], root: Path) -> list[str]:
    return [w.replace("runs/", f"{root}/runs/").replace("out/", f"{root}/out/") for w in words]


def steps_in(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_quick_start_then_continue_training_then_export_and_generate(tmp_path, data_cache, capsys):
    quick = block_after(ROOT / "README.md", "Train, export, generate:")
    continued = block_after(ROOT / "docs" / "checkpoints.md", "## Continue training")
    assert [Path(w[1]).name for w in quick] == ["train.py", "export_hf.py", "generate.py", "generate.py"]
    assert [Path(w[1]).name for w in continued] == ["train.py", "train.py"]
    # The page's totals (200, then 400, then the first run's own) scaled to 2, 3 and 3: each run goes on from the last.
    trains = [(quick[0], "2"), (continued[0], "3"), (continued[1], "3")]
    for words, steps in trains:
        words = localised(words, tmp_path)
        argv = [w for w in words[2:] if not w.startswith("train.steps=")]
        argv += [f"train.steps={steps}", "logger=none", "train.log_every=1", f"data.cache_dir={data_cache}"]
        preflight(argv)  # exit 2 (SystemExit) on the first problem, as train.py does before launching
        run_dir = next(w.split("=", 1)[1] for w in argv if w.startswith("hydra.run.dir="))
        cfg = compose_config([w for w in argv if not w.startswith("hydra.")])
        Trainer(cfg, ParallelGrid.single(torch.device("cpu")), Path(run_dir)).fit()
    runs = tmp_path / "runs"
    assert steps_in(runs / "demo-more") == [3]  # resumed from the demo's step 2
    assert steps_in(runs / "demo") == [1, 2, 3]  # resume=auto went on in the same run directory
    assert (runs / "demo" / "checkpoints" / "step_00000003").is_dir()

    export, generate = script("export_hf"), script("generate")
    assert export.main(localised(quick[1], tmp_path)[2:]) == 0
    capsys.readouterr()
    assert generate.main(localised(quick[2], tmp_path)[2:]) == 0
    assert capsys.readouterr().out.strip(), "generate.py printed nothing"
    # The run's own checkpoint in the page's layout, emulated here (the same lists and stages in this process; the
    # launched workers' path is tests/test_generation.py's): greedy, so the same text as one process.
    greedy = ["--temperature", "0", "--max-new-tokens", "8"]
    assert generate.main([*localised(quick[3], tmp_path)[2:], "parallel.emulate=true", *greedy]) == 0
    laid_out = capsys.readouterr().out
    assert generate.main([*localised(quick[3], tmp_path)[2:4], *greedy]) == 0
    assert laid_out.strip() and laid_out == capsys.readouterr().out
