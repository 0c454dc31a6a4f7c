"""Launch paths: self-launch through the torchrun launcher API, and torchrun itself; one run directory."""

import json
import os
import subprocess
import sys
from multiprocessing.pool import ThreadPool
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.shared import once_per_session
from tests.spawn import rendezvous_store

# No warm-up and a real learning rate: the runs compared below must move (the default warm-up keeps lr ~1e-5).
TINY = ["model=tiny", "train.seq_len=32", "train.micro_batch_size=2", "schedule.n_microbatches=4",
        "data.num_docs=300", "logger=none", "train.dtype=fp32", "train.log_every=1", "optim.warmup_steps=0",
        "optim.lr=1e-3"]


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def single_process_losses(tmp_path, *extra: str) -> list[float]:
    """The same run in this process, one rank (the reference the launched layouts must equal)."""
    import torch

    from parallel.grid import ParallelGrid
    from tests.equivalence import compose_run_config, run_training

    cfg = compose_run_config([*TINY, *extra], tmp_path / "cache")
    return run_training(cfg, ParallelGrid.single(torch.device("cpu")), tmp_path / "single")["losses"]


def test_world_size_mismatch_is_refused_before_training(tmp_path, data_cache, monkeypatch, capsys):
    """train.py's pre-launch check, through its entry point in this process (it ends before Hydra runs)."""
    from tests.test_config_errors import train_py_here

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    result = train_py_here(["parallel.tp=2", "parallel.pp=2", *TINY, f"data.cache_dir={data_cache}",
                            f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert result.returncode == 2 and not (tmp_path / "run").exists()
    assert result.stderr.strip().splitlines() == [
        "sluice: config error: world size 2 is not a multiple of parallel.tp*pp = 2*2; "
        "launch a multiple of 4 processes or change parallel.tp/pp"]


def slurm_stand_ins(tmp_path) -> dict[str, str]:
    """The environment of the sbatch script under stand-ins for srun/scontrol: one node, two CPU workers."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/usr/bin/env bash\nshift\nexec \"$@\"\n")  # drop --kill-on-bad-exit
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1",
            "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(ROOT), "GPUS_PER_NODE": "2",
            "PYTHON_BIN": os.path.dirname(sys.executable), "RUN_DIR": str(tmp_path / "run")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, data_cache) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """`launch_all`, once per session: pytest-xdist's work stealing may hand this module's tests to both workers."""
    return once_per_session(tmp_path_factory, "launched", lambda root: launch_all(root, data_cache))


def launch_all(base: Path, data_cache: Path) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The module's three train.py launches side by side (independent runs: their start-ups overlap): a sweep
    through Hydra's basic launcher, the sbatch script under Slurm stand-ins, and an emulated pipeline."""
    store = rendezvous_store(300)  # held here: torchrun's rendezvous joins it as a client, no port is re-bound
    (base / "slurm").mkdir()
    slurm = {**slurm_stand_ins(base / "slurm"), "RDZV_PORT": str(store.port)}
    commands = {
        "sweep": ([sys.executable, "train.py", "-m", "train.steps=1,2", *TINY, f"data.cache_dir={data_cache}",
                   f"hydra.sweep.dir={base / 'sweep'}"], {}),
        "slurm": (["bash", "scripts/slurm/train.sbatch", "parallel.pp=2", *TINY, "train.steps=2",
                   f"data.cache_dir={data_cache}"], slurm),
        "emulated": ([sys.executable, "train.py", "train.steps=2", "parallel.pp=2", "parallel.emulate=true", *TINY,
                      f"data.cache_dir={data_cache}", f"hydra.run.dir={base / 'emulated'}"], {}),
    }
    with ThreadPool(len(commands)) as pool:
        results = pool.map(lambda name: subprocess.run(
            commands[name][0], cwd=ROOT, capture_output=True, text=True, timeout=300,
            env={**os.environ, **commands[name][1]}), commands)
    return {name: (result, base / name) for name, result in zip(commands, results)}


def test_sweep_runs_every_job_in_its_own_run_directory(launched):
    """Hydra's basic launcher (a job that self-launches workers: tests/test_submitit.py)."""
    result, sweep = launched["sweep"]
    assert result.returncode == 0, result.stderr[-2000:]
    one, two = losses(sweep / "0"), losses(sweep / "1")
    assert len(one) == 1 and len(two) == 2 and one[0] == two[0]


def test_slurm_script_launches_torchrun_per_node(launched):
    """The sbatch script under stand-ins for srun/scontrol: one node, two CPU workers."""
    result, slurm = launched["slurm"]
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(losses(slurm / "run")) == 2


def test_emulated_pipeline_runs_in_one_process_from_the_command_line(launched, tmp_path):
    emulated, run_dir = launched["emulated"]
    assert emulated.returncode == 0, emulated.stderr[-2000:]
    assert "launching" not in (run_dir / "train.log").read_text()  # no workers were started
    assert losses(run_dir) == pytest.approx(single_process_losses(tmp_path, "train.steps=2"), rel=1e-5)
