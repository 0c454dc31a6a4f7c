"""Resuming without traps (issue 48 item 5): `checkpoint.resume=auto` in a fresh directory names the earlier run of the
same overrides instead of starting over, the continue command reproduces the launcher and its world size, and a resume
at another global batch is refused unless `train.allow_batch_change=true`. All in this process: the pre-launch path
of train.py (tests/test_config_errors.py's launch_here) on checkpoints made by hand (meta.json and COMPLETE)."""

import json
import sys
from pathlib import Path

import yaml

from checkpoint.meta_schema import FORMAT
from tests.test_config_errors import launch_here
from training.report.console import RunSummary, format_summary, interpreter, resume_command

TINY = ["model=tiny", "train.seq_len=32", "train.micro_batch_size=2", "schedule.n_microbatches=2", "logger=none",
        "train.steps=4", "data.num_docs=200", "optim.warmup_steps=1"]


def fake_run(run_dir: Path, overrides: list[str], step: int | None = None, dp: int = 1) -> Path | None:
    """A run directory as Hydra and a run leave it: its recorded overrides, and a complete checkpoint at `step`
    written by `dp` replicas with TINY's batch keys."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if step is None:
        return None
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": step, "loss": 1.0}) + "\n")
    saved = run_dir / "checkpoints" / f"step_{step:08d}"
    saved.mkdir(parents=True)
    layout = {"dp": dp, "tp": 1, "pp": 1, "n_microbatches": 2, "micro_batch_size": 2}
    (saved / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step, "model": {}, "layout": layout,
                                                 "data": {"samples_consumed": 4 * step, "num_samples": 200, "seed": 42}}))
    (saved / "COMPLETE").write_text("complete\n")
    return saved


def test_resume_auto_in_a_fresh_directory_names_the_earlier_run_of_the_same_overrides(tmp_path, data_cache, capsys):
    overrides = [*TINY, f"data.cache_dir={data_cache}"]
    earlier, fresh = tmp_path / "runs" / "first", tmp_path / "runs" / "second"
    saved = fake_run(earlier, [*overrides, f"hydra.run.dir={earlier}"], step=2)
    fake_run(tmp_path / "runs" / "other", [*overrides, "optim.lr=1e-3"], step=3)  # other overrides: not the same run
    fake_run(fresh, [*overrides, "train.steps=8", "checkpoint.resume=auto", f"hydra.run.dir={fresh}"])
    refused = launch_here([*overrides, "train.steps=8", "checkpoint.resume=auto", f"hydra.run.dir={fresh}"], capsys)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines() == [
        f"sluice: config error: checkpoint.resume=auto: {fresh} holds no checkpoint, but {earlier} holds "
        f"step_00000002 of a run with the same overrides; continue that run with hydra.run.dir={earlier} "
        f"checkpoint.resume=auto (or checkpoint.resume={saved}), or start over with checkpoint.resume=none"]


def test_a_resume_at_another_global_batch_is_refused_in_one_line(tmp_path, data_cache, capsys):
    run_dir = tmp_path / "run"
    saved = fake_run(run_dir, [], step=2, dp=2)  # written by `torchrun --nproc-per-node 2`: global batch 8
    refused = launch_here([*TINY, f"data.cache_dir={data_cache}", "checkpoint.resume=auto",
                           f"hydra.run.dir={run_dir}"], capsys)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines() == [
        f"sluice: config error: checkpoint {saved} was written at a global batch of 8 (dp 2 x schedule.n_microbatches "
        "2 x train.micro_batch_size 2) and this run has 4 (dp 1 x schedule.n_microbatches 2 x train.micro_batch_size "
        "2); launch it as before (the same world size and batch keys), or set train.allow_batch_change=true to "
        "continue at the new batch"]


def test_the_continue_commands_reproduce_the_launcher_and_its_world(tmp_path):
    run_dir = tmp_path / "run"
    fake_run(run_dir, ["parallel.tp=2", "train.steps=20"])
    tail = f"train.py parallel.tp=2 train.steps=20 hydra.run.dir={run_dir} checkpoint.resume=auto"
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}
    assert resume_command(run_dir, torchrun, []) == f"torchrun --nproc-per-node 2 {tail}"
    nodes = {**torchrun, "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "4"}
    assert resume_command(run_dir, nodes, []) == \
        f"torchrun --nnodes 4 <same rendezvous options> --nproc-per-node 8 {tail}"
    assert resume_command(run_dir, {**torchrun, "SLUICE_SELF_LAUNCHED": "1"}, []) == f"{sys.executable} {tail}"
    assert resume_command(run_dir, {}, []) == f"{sys.executable} {tail}"

    summary = RunSummary(steps=5, wall_time_s=1.0, final_loss=2.5, final_val_loss=None, mean_tokens_per_s=None,
                         outputs={"checkpoints": "run/checkpoints"}, launcher="torchrun --nproc-per-node 2")
    assert "  continue: torchrun --nproc-per-node 2 train.py <same overrides> train.steps=<new total> " \
           "checkpoint.resume=run/checkpoints" in format_summary(summary, 5)
    summary.launcher = None
    assert f"  continue: {interpreter()} train.py <same overrides>" in "\n".join(format_summary(summary, 5))
