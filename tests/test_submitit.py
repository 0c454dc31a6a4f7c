"""Sweeps through the submitit launcher, on submitit's local executor (hydra/launcher=local)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

TINY = ["model=tiny", "train.seq_len=32", "train.micro_batch_size=2", "schedule.n_microbatches=2",
        "data.num_docs=300", "train.steps=2", "logger=none", "train.dtype=fp32", "train.log_every=1"]


def sweep(tmp_path, cache, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", "-m", "hydra/launcher=local", *TINY, *overrides,
                           f"data.cache_dir={cache}", f"hydra.sweep.dir={tmp_path}/sweep"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_two_job_sweep_runs_to_completion_through_submitit(tmp_path, data_cache):
    result = sweep(tmp_path, data_cache, "parallel.pp=1,2")  # job 1's task starts its node's two workers itself
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Submitit 'local' sweep output dir" in result.stdout + result.stderr
    single, pipelined = losses(tmp_path / "sweep" / "0"), losses(tmp_path / "sweep" / "1")
    assert len(single) == 2 and pipelined == pytest.approx(single, rel=1e-5)
    assert "launching 2 local workers" in (tmp_path / "sweep" / "1" / "train.log").read_text()
    assert len(list((tmp_path / "sweep" / ".submitit").glob("*/*_result.pkl"))) == 2


def test_a_bad_job_stops_the_sweep_before_anything_is_submitted(tmp_path, data_cache, monkeypatch, capsys):
    """train.py's pre-launch check, through its entry point in this process (it ends before Hydra runs)."""
    from tests.test_config_errors import train_py_here

    result = train_py_here(["-m", "hydra/launcher=local", *TINY, "train.steps=2,0", f"data.cache_dir={data_cache}",
                            f"hydra.sweep.dir={tmp_path}/sweep"], monkeypatch, capsys)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice: config error:") and "train.steps" in lines[0]
    assert not (tmp_path / "sweep").exists()


def test_a_multi_node_submitit_task_starts_its_nodes_share(monkeypatch):
    from training.launch.cluster import is_launch_leader, node_launch

    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_JOB_ID": "12345"}
    for key, value in env.items():  # submitit's SlurmJobEnvironment reads the process environment
        monkeypatch.setenv(key, value)
    node = node_launch(16, env)
    assert (node.nnodes, node.nproc_per_node, node.rdzv_endpoint) == (2, 8, "gpu07:32345")
    assert node.run_id == "sluice-12345"
    with pytest.raises(ValueError, match="do not split evenly over 2 nodes"):
        node_launch(3, env)
    alone = node_launch(4, {"SUBMITIT_EXECUTOR": "local"})
    assert (alone.nnodes, alone.nproc_per_node, alone.rdzv_endpoint) == (1, 4, "127.0.0.1:0")
    assert is_launch_leader({}) and is_launch_leader({"SLURM_PROCID": "0"})
    assert not is_launch_leader({"SLURM_PROCID": "1"}) and not is_launch_leader({"RANK": "3"})
