"""The sbatch script's input checks and environment, under stand-ins for srun and scontrol."""

import os
import subprocess
import sys

from tests.conftest import ROOT


def stand_ins(tmp_path, with_scontrol: bool = True) -> str:
    """A bin folder whose srun prints the environment it would pass on, then the command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "srun").write_text('#!/bin/sh\necho "SRUN_CPUS_PER_TASK=$SRUN_CPUS_PER_TASK '
                                  'OMP_NUM_THREADS=$OMP_NUM_THREADS"\necho "$@"\n')
    tools = ["srun"]
    if with_scontrol:
        (bin_dir / "scontrol").write_text("#!/bin/sh\necho node7\necho node8\n")
        tools.append("scontrol")
    for tool in tools:
        (bin_dir / tool).chmod(0o755)
    return str(bin_dir)


def sbatch(tmp_path, env: dict, with_scontrol: bool = True) -> subprocess.CompletedProcess:
    """Run the script with a minimal PATH (no nvidia-smi) and the given Slurm-like environment."""
    path = f"{stand_ins(tmp_path, with_scontrol)}:/usr/bin:/bin"
    base = {"PATH": path, "SLURM_JOB_NODELIST": "node[7-8]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42",
            "SLURM_SUBMIT_DIR": str(ROOT), "PYTHON_BIN": os.path.dirname(sys.executable)}
    return subprocess.run(["bash", "scripts/slurm/train.sbatch", "parallel.tp=2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**base, **env})


def test_gpus_per_node_unset_without_nvidia_smi_is_one_clear_line(tmp_path):
    result = sbatch(tmp_path, {})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "train.sbatch: GPUS_PER_NODE is unset and nvidia-smi is not available: set GPUS_PER_NODE to the number "
        "of workers per node (e.g. GPUS_PER_NODE=8 sbatch ...)"]


def test_bad_inputs_are_named(tmp_path):
    assert "not a positive number" in sbatch(tmp_path / "a", {"GPUS_PER_NODE": "eight"}).stderr
    assert "torchrun not found" in sbatch(tmp_path / "b", {"GPUS_PER_NODE": "2", "PYTHON_BIN": "nowhere"}).stderr
    no_slurm = sbatch(tmp_path / "c", {"GPUS_PER_NODE": "2", "SLURM_JOB_NODELIST": ""})
    assert no_slurm.returncode == 2 and "submit with sbatch" in no_slurm.stderr
    assert "scontrol not found" in sbatch(tmp_path / "d", {"GPUS_PER_NODE": "2"}, with_scontrol=False).stderr


def test_cpus_and_threads_reach_srun(tmp_path):
    result = sbatch(tmp_path, {"GPUS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "32"})
    assert result.returncode == 0, result.stderr
    env_line, command = result.stdout.strip().splitlines()[-2:]
    assert env_line == "SRUN_CPUS_PER_TASK=32 OMP_NUM_THREADS=8"
    assert "--nnodes 2 --nproc-per-node 4" in command and "--rdzv-endpoint node7:20042" in command  # job 42
    assert command.endswith("train.py hydra.run.dir=outputs/slurm/42 parallel.tp=2")
    kept = sbatch(tmp_path / "kept", {"GPUS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "32", "OMP_NUM_THREADS": "3"})
    assert "OMP_NUM_THREADS=3" in kept.stdout


def test_the_port_follows_the_job_and_the_network_variables_are_shown(tmp_path):
    """Two jobs on one head node rendezvous on two ports; the NCCL/gloo interface settings in force are printed."""
    other = sbatch(tmp_path, {"GPUS_PER_NODE": "4", "SLURM_JOB_ID": "123456", "NCCL_SOCKET_IFNAME": "ib0"})
    assert other.returncode == 0, other.stderr
    assert "--rdzv-endpoint node7:23456" in other.stdout
    assert "train.sbatch: network: NCCL_SOCKET_IFNAME=ib0" in other.stdout
    chosen = sbatch(tmp_path / "set", {"GPUS_PER_NODE": "4", "RDZV_PORT": "29400"})
    assert "--rdzv-endpoint node7:29400" in chosen.stdout
