"""Under torchrun: `--max-restarts` resumes bit for bit whichever restarted rank arrives first, and every report
lands in the run directory (never the working directory), naming a stalled rank by the phase it is in."""

import json
import os
import signal
import subprocess
import sys
from multiprocessing.pool import ThreadPool
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.equivalence import layouts_worker
from tests.spawn import run_workers
from tests.test_reliability import TINY, pids_where

TORCHRUN = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--monitor-interval", "0.1",
            "--nproc-per-node", "2"]
RESTART = ["parallel.dp=2", "train.steps=5", "checkpoint.every=1", "checkpoint.resume=auto", "optim.lr=1e-3"]


def torchrun(args: list[str], cwd: Path, logs: Path, timeout: float) -> subprocess.CompletedProcess:
    """One torchrun, in its own session, ended with every worker it started if it outlives `timeout`."""
    proc = subprocess.Popen([*TORCHRUN[:4], "--log-dir", str(logs), *TORCHRUN[4:], *args], cwd=cwd, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        workers = pids_where(3, proc.pid)  # torchrun starts each worker in a session of its own
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"torchrun ran past {timeout}s: {stderr[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


def sluice_lines(stderr: str) -> list[str]:
    """The `sluice:` lines as a terminal shows them (torchrun's agent adds its own report, traceback included)."""
    screen = [segment.strip(" ") for line in stderr.split("\n") for segment in line.split("\r")]
    return [line for line in screen if line.startswith("sluice: ")]


def losses_by_step(run_dir: Path) -> list[float]:
    """Each step's loss in metrics.jsonl, by step; a step run again after a restart keeps its last record."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return list(dict(sorted({r["step"]: r["loss"] for r in rows}.items())).values())


def test_a_rank_killed_under_torchrun_max_restarts_resumes_bit_for_bit(torchrun_runs, data_cache, tmp_path):
    """The killed run of `torchrun_runs`: rank 1 is killed at step 3; in the restarted group it joins last, after
    rank 0 entered the rendezvous (the order that read the dead rank's address from torchrun's store and failed, or
    hung, before each start had a store of its own)."""
    result, _, run_dir = torchrun_runs["killed"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sluice: rank 1 died (SIGKILL" in result.stderr and "connectFullMesh" not in result.stderr
    log = (run_dir / "train.log").read_text()
    assert "resumed from" in log, log[-2000:]
    runs = [([*TINY, *RESTART[:-2], RESTART[-1]], str(tmp_path / "straight"))]  # the same run, uninterrupted
    straight = run_workers(layouts_worker, 2, runs, str(data_cache), timeout=300)[0][0]
    assert losses_by_step(run_dir) == straight["losses"]


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory, data_cache) -> dict[str, tuple[subprocess.CompletedProcess, Path, Path]]:
    """Three torchrun runs side by side (their start-ups and timeouts overlap), each started in an empty working
    directory: rank 1 killed at step 3 under --max-restarts 1 (started through tests/late_rank_train.py), rank 0
    stalled in start-up, and rank 1 frozen (SIGSTOP) at the start of step 3."""
    faults = {"killed": ["kill@rank=1,step=3", *RESTART],
              "start-up": ["stall@rank=0,step=0", "parallel.dp=2", "parallel.startup_timeout_s=10"],
              "step 3": ["stop@rank=1,step=3", "parallel.dp=2", "parallel.timeout_s=8", "train.steps=100000"]}
    base = tmp_path_factory.mktemp("torchrun-runs")
    procs = {}
    for name, (fault, *args) in faults.items():
        cwd, run_dir = base / name / "cwd", base / name / "run"
        cwd.mkdir(parents=True)
        entry = ["--max-restarts", "1", str(ROOT / "tests" / "late_rank_train.py")] if name == "killed" else []
        command = [*entry, str(ROOT / "train.py"), *TINY, *args, f"debug.fault='{fault}'",
                   f"data.cache_dir={data_cache}", f"hydra.run.dir={run_dir}"]
        procs[name] = (command, cwd, run_dir, 300 if name == "killed" else 240)
    with ThreadPool(len(procs)) as pool:
        results = pool.map(lambda item: torchrun(item[0], item[1], item[1].parent / "torchrun", item[3]),
                           procs.values())
    return {name: (result, cwd, run_dir) for (name, (_, cwd, run_dir, _)), result in zip(procs.items(), results)}


def test_a_start_up_failure_under_torchrun_reports_into_the_run_directory_only(torchrun_runs):
    result, cwd, run_dir = torchrun_runs["start-up"]
    assert result.returncode != 0
    assert list(cwd.iterdir()) == []  # rank 1 ran Hydra here: before, its failures/ and hang/ landed here
    record = json.loads((run_dir / "failures" / "rank1.json").read_text())
    assert record["message"].startswith("rank 0 stalled in a debug.fault stall (start-up"), record
    assert "parallel.startup_timeout_s=10" in record["message"] and f"hang dump in {run_dir / 'hang'}" in \
        record["message"]
    assert json.loads((run_dir / "hang" / "rank1.json").read_text())["reason"] == "timeout"
    assert sluice_lines(result.stderr)[0] == f"sluice: {record['message']}"


def test_a_rank_frozen_at_step_3_is_named_in_step_3(torchrun_runs):
    """Its heartbeat said so as the step began, not a second later: the last periodic beat described start-up or
    an earlier step (steps of the tiny model take a fraction of a second)."""
    result, cwd, run_dir = torchrun_runs["step 3"]
    assert result.returncode != 0
    line = sluice_lines(result.stderr)[0]
    assert line.startswith("sluice: rank 1 stalled at step 3 in step 3: starting, last heard "), line
    assert list(cwd.iterdir()) == [] and (run_dir / "failures" / "rank0.json").exists()
