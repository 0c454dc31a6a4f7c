"""The console: one bar on rank 0, log lines above it, the run directory first, a summary last; used run dirs."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.test_config_errors import launch_here
from training.report.console import RunSummary, run_dir_problem, format_summary, interpreter

TINY = ["model=tiny", "train.seq_len=32", "train.micro_batch_size=2", "schedule.n_microbatches=4",
        "data.num_docs=300", "train.log_every=1", "train.steps=3", "optim.warmup_steps=1", "parallel.pp=2"]


def test_a_used_run_directory_is_refused_unless_resuming(tmp_path):
    assert run_dir_problem(tmp_path, None) is None
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    problem = run_dir_problem(tmp_path, None)
    assert problem and "already holds metrics.jsonl" in problem and "hydra.run.dir" in problem and "checkpoint.resume" in problem
    assert run_dir_problem(tmp_path, "auto").startswith("checkpoint.resume=auto: ")  # no checkpoint to resume from
    assert run_dir_problem(tmp_path, str(tmp_path / "checkpoints" / "step_00000001")) is None  # checked when loaded
    assert run_dir_problem(tmp_path, "none") == problem  # `none` is the explicit "do not resume"


def test_summary_lines():
    summary = RunSummary(steps=5, wall_time_s=12.34, final_loss=2.5, final_val_loss=2.75, mean_tokens_per_s=1234.4,
                         outputs={"metrics": "run/metrics.jsonl", "checkpoints": "run/checkpoints"})
    python = interpreter()  # the hints name the interpreter the run was started with, not a bare `python`
    assert python == os.path.relpath(sys.executable) or python == sys.executable
    assert format_summary(summary, 5) == [
        "done: 5 steps in 12.3 s, final loss 2.5000, val loss 2.7500, mean 1234 tokens/s",
        "  metrics: run/metrics.jsonl", "  checkpoints: run/checkpoints", "next:",
        f"  continue: {python} train.py <same overrides> train.steps=<new total> checkpoint.resume=run/checkpoints",
        f"  export:   {python} scripts/export_hf.py run/checkpoints <out folder>",
        f'  generate: {python} scripts/generate.py <out folder> "<prompt>"']
    assert format_summary(summary, 10)[0].startswith("stopped early (of 10 steps): 5 steps")
    without = RunSummary(steps=5, wall_time_s=1.0, final_loss=2.5, final_val_loss=None, mean_tokens_per_s=None,
                         outputs={"metrics": "run/metrics.jsonl"})
    assert format_summary(without, 5)[-1] == "  metrics: run/metrics.jsonl"  # nothing to continue from


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="no torchrun")
def test_torchrun_pp2_console_one_run_directory_then_a_second_fresh_run_is_refused(tmp_path, data_cache,
                                                                                        capsys):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run_dir = tmp_path / "run"
    common = [*TINY, f"data.cache_dir={data_cache}", f"hydra.run.dir={run_dir}"]
    cwd = tmp_path / "cwd"  # a working directory of its own: whatever the repository holds cannot matter
    cwd.mkdir()
    # One pipe for stdout and stderr, unbuffered: what a terminal would show, in order.
    result = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(ROOT / "train.py"), *common],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    assert not list(cwd.iterdir())  # rank 1 wrote no Hydra files of its own: rank 0's directory is the run's
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    # A pipe is no terminal: no bar and no carriage return, only log lines (training/report/console.py's progress_bar).
    assert "\r" not in out and "train:   0%" not in out, out[-3000:]
    log_lines = [s for s in out.split("\n") if "][sluice][" in s]
    assert log_lines and all(s.startswith("[") for s in log_lines)  # each log line a line of its own
    text = [s.split(" - ", 1)[1] for s in log_lines]
    # One plain line per logged step, written by rank 0 alone.
    assert [t.split()[1] for t in text if t.startswith("step ")] == ["1/3", "2/3", "3/3"], text
    assert text[0] == f"run directory: {run_dir}"
    assert text.index(f"run directory: {run_dir}") < text.index(next(t for t in text if t.startswith("step 1/3 ")))
    done = next(t for t in text if t.startswith("done: "))
    assert re.match(r"done: 3 steps in [\d.]+ s, final loss \d+\.\d{4}, mean \d+ tokens/s$", done)
    assert text.index(done) > max(i for i, t in enumerate(text) if t.startswith("step "))
    assert f"  metrics: {run_dir / 'metrics.jsonl'}" in text and f"  tensorboard: {run_dir / 'tb'}" in text

    again = launch_here(common, capsys)  # train.py's path in this process: refused before any worker starts
    assert again.returncode == 2
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "already holds metrics.jsonl" in lines[0] and "hydra.run.dir" in lines[0]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3  # nothing appended


def test_a_step_line_says_where_the_run_is_in_plain_numbers_with_each_objectives_terms():
    """What a Slurm log shows per logged step: `step N/total`, the objective's own terms (here distillation's CE and
    KL), numbers without exponents where they are large, the time taken and the time left at this pace."""
    from training.report.metrics import step_line

    record = {"loss": 7.593151, "aux_loss": 0.0, "lr": 3e-05, "grad_norm": 1.25, "tokens": 4096,
              "tokens_per_s": 12650.3, "step_time_s": 0.3, "ce_loss": 2.5, "distill_loss": 0.75,
              "peak_mem_bytes": 10**9, "expert_imbalance_by_layer": {"0": 1.1}}
    assert step_line(35, 200, record, 70.0, 35) == ("step 35/200 loss 7.593 lr 3e-05 grad_norm 1.25 tokens_per_s 12650 "
                                                    "ce_loss 2.5 distill_loss 0.75 elapsed 1m10s eta 5m30s")
    assert step_line(3, 3, {"loss": 1.0, "aux_loss": 0.01}, 7200.0, 1).endswith("aux_loss 0.01 elapsed 2h00m eta 0s")
