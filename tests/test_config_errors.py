"""End to end through `python train.py`: a bad config exits 2 with one line before anything starts.

Three representatives (a bad value, an unknown key added with `+`, an override Hydra itself refuses): the whole
catalogue runs through the same pre-launch check in-process in tests/test_config_catalogue.py, since each
`python train.py` pays seconds of imports on two cores. For the same reason a bad run directory, a bad sweep job
and --help go through train.py's entry point (training.launch.cli.main) in this process: they end before Hydra runs."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from training.launch.cli import main, preflight

BAD_CONFIGS = [
    (["model=tiny", "parallel.tp=3"], "parallel.tp=3 does not divide num_attention_heads=4; choose tp in {1, 2}"),
    (["+train.eval_evry=10"], "train.eval_evry: unknown config key; did you mean train.eval_every?"),
    (["model=nope"], "model=nope: no such preset"),
]


def run_train(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, expected", BAD_CONFIGS, ids=[" ".join(a) for a, _ in BAD_CONFIGS])
def test_bad_config_exits_2_with_one_line(args, expected, tmp_path):
    result = run_train([*args, f"hydra.run.dir={tmp_path}/run"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sluice: config error: ")
    assert expected in lines[0]
    assert "+" not in lines[0].partition("did you mean")[2]  # never suggests adding a key
    assert not (tmp_path / "run").exists()  # nothing started: Hydra never made the run directory


def train_py_here(args: list[str], monkeypatch, capsys) -> subprocess.CompletedProcess:
    """`python train.py args` through its entry point in this process: its exit code (0 when it returns) and output.
    A run Hydra starts configures the root logger (train.log, the console): that is put back after, so later tests
    log as before."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    code = 0
    try:
        main()
    except SystemExit as leave:
        code = leave.code or 0
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:], root.level = handlers, level
    out = capsys.readouterr()
    return subprocess.CompletedProcess(sys.argv, code, out.out, out.err)


def launch_here(args: list[str], capsys) -> subprocess.CompletedProcess:
    """`python train.py args` in this process for commands refused after Hydra composed the run but before any worker
    starts (a used run directory, no layout within the budget): the pre-launch check, then training.launch.workers.run on
    the composed config. Hydra's own part between them, making the run directory, is left out."""
    from training.config.schema import compose_config
    from training.launch.workers import run

    run_dir = next(arg.partition("=")[2] for arg in args if arg.startswith("hydra.run.dir="))
    with pytest.raises(SystemExit) as leave:
        preflight(args)
        run(compose_config([arg for arg in args if not arg.startswith("hydra.")]), Path(run_dir))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["train.py", *args], leave.value.code, out.out, out.err)


def test_bad_output_directory_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    result = train_py_here([f"hydra.run.dir={tmp_path}/file/run"], monkeypatch, capsys)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"sluice: config error: hydra.run.dir={tmp_path}/file/run cannot be created: {tmp_path}/file is a file; "
        "choose another hydra.run.dir"]


def test_bad_job_in_a_sweep_is_caught_before_any_job_runs(tmp_path, monkeypatch, capsys):
    result = train_py_here(["-m", "train.steps=1,0", f"hydra.sweep.dir={tmp_path}/sweep"], monkeypatch, capsys)
    assert result.returncode == 2
    assert "train.steps=0 must be positive" in result.stderr
    assert not (tmp_path / "sweep").exists()


def test_help_describes_sluice_keys_and_examples(monkeypatch, capsys):
    result = train_py_here(["--help"], monkeypatch, capsys)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Sluice trains MiniMind language models")
    assert "parallel.tp = 1" in result.stdout and "schedule.n_microbatches = 4" in result.stdout
    assert result.stdout.count("python train.py ") >= 3


def test_cfg_job_prints_the_composed_config():
    result = run_train(["--cfg", "job", "model=tiny", "train.steps=7"])
    assert result.returncode == 0, result.stderr
    assert "steps: 7" in result.stdout and "backends:" in result.stdout
