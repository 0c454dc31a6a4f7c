"""Launched runs that fail on purpose: one line, hang summaries naming the stalled rank, Ctrl-C, no orphans."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from multiprocessing.pool import ThreadPool
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.shared import once_per_session

TINY = ["model=tiny", "train.seq_len=32", "train.micro_batch_size=2", "schedule.n_microbatches=2",
        "data.num_docs=300", "logger=none", "train.dtype=fp32", "train.log_every=1", "optim.warmup_steps=1"]
TIMEOUT_S = 6  # the stall's bound; start-up has its own (parallel.startup_timeout_s), so no slow import trips it
# A stall during start-up is bounded by parallel.startup_timeout_s itself: long enough for the stalled rank to reach
# its stall (and publish a heartbeat) however slowly a loaded machine imports torch, short enough to wait out.
STARTUP_TIMEOUT_S = 15


def train(args: list[str], cache: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """A self-launched run of train.py that must end by itself (hard timeout)."""
    cmd = [sys.executable, "train.py", *TINY, *args, f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def sluice_lines(stderr: str) -> list[str]:
    """The `sluice:` lines as a terminal shows them (a progress bar's carriage returns start a line over)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    screen = [segment.strip(" ") for line in stderr.split("\n") for segment in line.split("\r")]
    return [line for line in screen if line.startswith("sluice:")]


def pids_where(field: int, value: int) -> list[int]:
    """Live processes whose /proc stat field (3: ppid, 4: pgid) equals value."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if fields[0] != "Z" and int(fields[field - 2]) == value:
            found.append(int(entry.name))
    return found


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll predicate (a condition, not a sleep as synchronisation) until true or fail after timeout."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.2)


STALLS = {  # a stalled DP rank: tests/test_launch_faults.py (SIGSTOP under torchrun dp2)
    "pipeline": ("parallel.pp=2", "stall@rank=1,step=2,action=F0@s1", "receiving gradient from rank 1", "at step 2 "),
    "start-up": ("parallel.pp=2", "stall@rank=1,step=0", "start-up: joining the process group", ""),
}


def stall_args(name: str) -> list[str]:
    layout, fault, waiting, _ = STALLS[name]
    # Start-up gets its own bound: a busy machine may take long to import, which must not count as a stall after it.
    key, bound = ("parallel.startup_timeout_s", STARTUP_TIMEOUT_S) if "start-up" in waiting else \
        ("parallel.timeout_s", TIMEOUT_S)
    return ["train.steps=3", layout, f"{key}={bound}", f"debug.fault='{fault}'"]


@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory, data_cache) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """`fail_runs`, once per session: pytest-xdist's work stealing may hand this module's tests to both workers."""
    return once_per_session(tmp_path_factory, "failed-runs", lambda root: fail_runs(root, data_cache))


def fail_runs(base: Path, data_cache: Path) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Three self-launched pp2 runs that fail on purpose: a NaN on rank 1 at step 2 and rank 1 stalled in the
    pipeline side by side (the suite waits once for their start-ups and timeouts), then rank 1 stalled in start-up
    alone: its report names rank 1 only if rank 1 reaches its stall within rank 0's start-up bound, which a machine
    busy with two other runs' imports did not give it once (rank 0 then rightly reports its own wait)."""
    plans = {"nan": ["train.steps=4", "parallel.pp=2", "debug.fault='nan@rank=1,step=2'"],
             **{name: stall_args(name) for name in STALLS}}
    together = [name for name in plans if name != "start-up"]
    with ThreadPool(len(together)) as pool:
        results = dict(zip(together, pool.map(lambda name: train(plans[name], data_cache, base / name / "run"),
                                               together)))
    results["start-up"] = train(plans["start-up"], data_cache, base / "start-up" / "run")
    return {name: (results[name], base / name / "run") for name in plans}


def test_nan_with_stop_fails_every_rank_naming_the_step_in_one_line(failed_runs):
    result, run_dir = failed_runs["nan"]
    assert result.returncode == 1
    [line] = sluice_lines(result.stderr)
    assert "non-finite loss and grad norm at step 2" in line and "train.on_nonfinite=stop" in line
    for rank in (0, 1):  # every rank stopped for the same reason
        assert "at step 2" in json.loads((run_dir / "failures" / f"rank{rank}.json").read_text())["message"]


@pytest.mark.parametrize("name", STALLS)
def test_stall_is_caught_by_the_hang_doctor_which_names_the_stalled_rank(failed_runs, name):
    _, _, waiting, at = STALLS[name]
    bound = STARTUP_TIMEOUT_S if "start-up" in waiting else TIMEOUT_S
    result, run_dir = failed_runs[name]
    assert result.returncode == 1
    lines = sluice_lines(result.stderr)
    # The heartbeats name the stalled rank first (alive, busy with no peer to wait for), then the wait that timed out.
    assert lines[0].startswith(f"sluice: rank 1 stalled {at}in a debug.fault stall (") and waiting in lines[0]
    assert "; rank(s) 0 waiting on it (rank 0: no progress for" in lines[0]
    summary = result.stderr[result.stderr.index("hang summary"):].splitlines()[1:]
    assert summary[0].strip().startswith("rank 1 ") and "is the stalled rank: a debug.fault stall" in summary[0]
    assert any(line.strip().startswith("rank 0 ") and "waits for rank(s) [1]" in line for line in summary)
    dumps = {d: json.loads((run_dir / "hang" / f"rank{d}.json").read_text()) for d in (0, 1)}
    assert dumps[0]["reason"] == "timeout" and dumps[1]["reason"] == "terminated"
    # Every rank was gone within timeout_s + 15 s of a stall after start-up: the stalled rank's dump, written as it
    # was stopped, says how long it had been stalled (at start-up it also waited out its peers' imports).
    if at:
        assert dumps[1]["blocked_s"] <= bound + 15


def launch_long_run(cmd: list[str], run_dir: Path, cache: Path, output=subprocess.PIPE) -> subprocess.Popen:
    """A run long enough to interrupt, in its own process group; `output` takes its stdout and stderr."""
    return subprocess.Popen([*cmd, *TINY, "train.steps=100000", f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"],
                            cwd=ROOT, stdout=output, stderr=output, text=True, start_new_session=True)


def wait_for_step_1(proc: subprocess.Popen, run_dir: Path) -> subprocess.Popen:
    """`proc` once rank 0 logged a step."""
    metrics = run_dir / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and metrics.stat().st_size > 0 or proc.poll() is not None, 240, "step 1")
    assert proc.poll() is None, proc.communicate()[1][-3000:] if proc.stderr else proc.returncode
    return proc


def start_long_run(cmd: list[str], run_dir: Path, cache: Path) -> subprocess.Popen:
    """A run long enough to interrupt, in its own process group; returns once rank 0 logged a step."""
    return wait_for_step_1(launch_long_run(cmd, run_dir, cache), run_dir)


def test_ctrl_c_saves_a_two_worker_run_and_exits_130_with_the_resume_command(tmp_path, data_cache):
    proc = start_long_run([sys.executable, "train.py", "parallel.pp=2"], tmp_path / "run", data_cache)
    try:
        assert len(pids_where(3, proc.pid)) >= 2  # the two workers are the launcher's children
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130, stderr[-3000:]  # once -6: an elastic daemon thread aborted the exit
        lines = sluice_lines(stderr)  # the launcher passed it on: the workers finished the step and saved it
        # Rank 0's notice: from its own copy of the signal (the step is N or N + 1: the stop rides a step's vote, and a
        # signal after step N's vote stops after N + 1), or from a vote that told it first (exact; its own copy came
        # late on a loaded machine). One notice either way.
        notice = re.fullmatch(r"sluice: SIGINT: stopping after step (\d+)(?:, or step (\d+) if step \1 is already "
                              r"ending)?; send it again to stop at once", lines[0])
        assert notice and len(lines) == 3 and lines[2] == "sluice: interrupted; every worker was stopped", lines
        step = int(re.search(r"at step (\d+):", lines[1]).group(1))
        first = int(notice.group(1))
        if notice.group(2) is None:
            assert step == first, lines
        else:
            assert int(notice.group(2)) == first + 1 and step in (first, first + 1), lines
        assert lines[1].startswith(f"sluice: interrupted by SIGINT at step {step}: saved checkpoint step {step} to ")
        assert (tmp_path / "run" / "checkpoints" / f"step_{step:08d}" / "COMPLETE").is_file()
        wait_until(lambda: not pids_where(4, proc.pid), 30, "no process of the run's group left")
    finally:
        if proc.poll() is None or pids_where(4, proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def test_workers_exit_when_their_launcher_is_killed_under_both_launchers(tmp_path, data_cache):
    """Both launchers side by side (their start-ups overlap). Their output goes nowhere: nobody reads it while the
    other run starts, and a full pipe would block a worker."""
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2"]
    launchers = {"torchrun": [*torchrun, "train.py"], "self-launch": [sys.executable, "train.py"]}
    procs = {name: launch_long_run([*cmd, "parallel.pp=2"], tmp_path / name, data_cache, subprocess.DEVNULL)
             for name, cmd in launchers.items()}
    workers: dict[str, list[int]] = {}

    def kill_the_started() -> bool:
        """Each launcher is killed as soon as its run logged a step, not once both have: its workers would otherwise
        train at full speed, taking CPU from the other run's start-up."""
        for name, proc in procs.items():
            if name in workers:
                continue
            assert proc.poll() is None, f"{name} ended before step 1: {proc.returncode}"
            metrics = tmp_path / name / "metrics.jsonl"
            if metrics.exists() and metrics.stat().st_size > 0:
                workers[name] = pids_where(3, proc.pid)
                assert len(workers[name]) >= 2, workers  # the two workers are the launcher's children
                proc.kill()  # SIGKILL: the launcher cannot stop anybody
        return len(workers) == len(procs)

    try:
        wait_until(kill_the_started, 240, "step 1 of both runs")
        for name, proc in procs.items():
            proc.communicate(timeout=30)
            wait_until(lambda: not any(Path(f"/proc/{pid}").exists() and pid in pids_where(4, proc.pid)
                                       for pid in workers[name]), 30, f"{name}'s workers to exit after it died")
    finally:
        for proc in procs.values():
            if pids_where(4, proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
