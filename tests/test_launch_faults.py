"""Real faults from outside: a worker stopped (SIGSTOP) or killed (SIGKILL) under self-launch and torchrun is named
first, promptly; train.max_restarts survives a kill bit for bit, and gives up on a fault that keeps coming back."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.equivalence import dense_params, layouts_worker
from tests.spawn import run_workers
from tests.test_reliability import TINY, pids_where, sluice_lines, wait_until

TORCHRUN = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--monitor-interval", "0.1",
            "--log-dir", "{tmp}/torchrun"]  # torchrun's own logs (without it: torchelastic_* in the temp folder)
LAUNCHERS = {  # launcher -> (command, layout, the rank to fault: its peer waits on it in P2P, or in a collective)
    "self-launch": ([sys.executable, "train.py"], ["parallel.pp=2"], 1),
    "torchrun": ([*TORCHRUN, "--nproc-per-node", "2", "train.py"], ["parallel.dp=2"], 1),
}
TIMEOUT_S = 15


TEMP = Path(tempfile.gettempdir()) / f"sluice-test-temp-{os.getpid()}"  # the runs' TMPDIR: theirs alone to fill


def unmapped_shared_memory() -> set[str]:
    """/dev/shm entries (semaphores, shared memory) that no live process maps at this moment."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return set()
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped |= {line.split(None, 5)[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line}
        except OSError:
            continue
    return {str(p) for p in shm.iterdir()} - mapped


def unowned_shared_memory() -> set[str]:
    """/dev/shm entries left behind: unmapped in two scans in a row. Under pytest-xdist other tests' processes
    create their own meanwhile, and one scan can catch an entry between its creation and its mapping (or a
    semaphore between creation and unlinking); a leaked entry stays in both."""
    return unmapped_shared_memory() & unmapped_shared_memory()


def residue() -> set[str]:
    """What the runs could leave behind outside their run directories: unowned semaphores and shared memory,
    launcher temp folders, and anything in the repository root. Not torch's compile cache folder: importing
    transformers' masking utilities imports torch._dynamo, which creates it in the temp folder of the first process
    that does so (the runs', unless this pytest process did first: that is why it showed only in some orders)."""
    return unowned_shared_memory() | {str(p) for p in TEMP.iterdir() if not p.name.startswith("torchinductor_")} | {
        str(p) for p in ROOT.iterdir()}


def nothing(rank: int, world_size: int) -> None:
    return None


@pytest.fixture(scope="module", autouse=True)
def leaves_nothing_behind():
    """Every run of this module, killed, stopped or restarted, leaves nothing behind once it ended. A process that
    dies leaves its multiprocessing semaphores to its resource tracker, which unlinks them shortly after (seen under
    load: three sem.mp-* gone seconds later), so a leak is what stays for 30 s."""
    run_workers(nothing, 2)  # the session's pool of 2 (this module's reference) holds its queues until the end
    TEMP.mkdir()
    before = residue()
    yield
    deadline = time.monotonic() + 30  # a resource tracker unlinks a dead process's semaphores when it gets to it
    while (left := residue() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == set()
    shutil.rmtree(TEMP)  # empty but for torch's cache folder


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the worker of global `rank` among the launcher's children (each names itself sluice-rank<R>)."""
    for pid in pids_where(3, launcher_pid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"sluice-rank{rank}":
                return pid
        except OSError:
            continue
    raise AssertionError(f"no worker of rank {rank} under pid {launcher_pid}")


def launch(cmd: list[str], args: list[str], run_dir: Path, cache: Path) -> subprocess.Popen:
    """A run in its own session; a thread keeps its stderr lines with their arrival times in `proc.lines` (a full
    pipe would block the run)."""
    cmd = [part.replace("{tmp}", str(run_dir.parent)) for part in cmd]
    proc = subprocess.Popen([*cmd, *TINY, *args, f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "TMPDIR": str(TEMP)})
    proc.lines = []
    proc.reader = timed_lines(proc.stderr, proc.lines)
    proc.ended_at = math.inf  # when the launcher exited, as it happened (not when a test got round to waiting)
    proc.waiter = threading.Thread(target=lambda: (proc.wait(), setattr(proc, "ended_at", time.monotonic())),
                                   daemon=True)
    proc.waiter.start()
    return proc


def started(proc: subprocess.Popen, run_dir: Path) -> subprocess.Popen:
    """`proc` once rank 0 logged step 2 (every worker is past start-up)."""
    wait_until(lambda: logged_steps(run_dir) >= 2 or proc.poll() is not None, 240, "step 2")
    assert proc.poll() is None, stderr_of(proc)[-3000:]
    return proc


def start(cmd: list[str], args: list[str], run_dir: Path, cache: Path) -> subprocess.Popen:
    return started(launch(cmd, args, run_dir, cache), run_dir)


def timed_lines(stream, out: list[tuple[float, str]]) -> threading.Thread:
    """Read `stream` line by line in a thread, keeping when each line arrived."""
    def read() -> None:
        for line in stream:
            out.append((time.monotonic(), line.rstrip("\n")))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def stderr_of(proc: subprocess.Popen) -> str:
    proc.reader.join(timeout=10)
    return "\n".join(line for _, line in proc.lines)


def logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, float]:
    """Wait for the run to end (killing its group if it does not); its stderr and how long that took."""
    began = time.monotonic()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None or pids_where(4, proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - began
    proc.waiter.join(timeout=10)  # it sets proc.ended_at
    return stderr_of(proc), took


def first_sluice_line(stderr: str) -> str:
    screen = [segment.strip(" ") for line in stderr.split("\n") for segment in line.split("\r")]
    return next((line for line in screen if line.startswith("sluice: ")), "")


def first_named(proc: subprocess.Popen) -> tuple[float, str]:
    """When the first `sluice:` line arrived, and the line."""
    return next(((at, part) for at, line in proc.lines for part in line.split("\r") if part.startswith("sluice: ")),
                (math.inf, ""))


RESTARTS = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=1", "train.max_restarts=1", "optim.lr=1e-3"]
CRASH = "debug.fault='crash@rank=1,step=5'"


@dataclass
class Faulted:
    """A run this module faulted: its process, its stderr once it ended, and when it was faulted and ended."""

    proc: subprocess.Popen
    target: int
    stderr: str = ""
    faulted_at: float = math.inf
    took: float = math.inf  # from the fault to the end of the run


@pytest.fixture(scope="module")
def faulted_runs(tmp_path_factory, data_cache) -> dict[str, Faulted]:
    """Four runs side by side, so that the suite waits once for their timeouts and start-ups: a worker stopped
    (SIGSTOP) under each launcher, a worker killed (SIGKILL) under torchrun, and a self-launched crash that comes
    back after its restart. Each is its own run in its own directory; only the waiting overlaps."""
    base = tmp_path_factory.mktemp("faulted")
    long_run = ["train.steps=100000", f"parallel.timeout_s={TIMEOUT_S}"]
    plans = {f"stopped under {name}": (cmd, layout, target) for name, (cmd, layout, target) in LAUNCHERS.items()}
    plans["killed under torchrun"] = LAUNCHERS["torchrun"]
    runs = {name: Faulted(launch(cmd, [*layout, *long_run], base / name / "run", data_cache), target)
            for name, (cmd, layout, target) in plans.items()}
    crash = launch([sys.executable, "train.py"], ["parallel.dp=2", *RESTARTS, CRASH], base / "crash" / "run",
                   data_cache)
    runs["crash"] = Faulted(crash, 1)
    try:
        # Each run is faulted as soon as it logged step 2, not once all have: a started run's workers would otherwise
        # train at full speed (CPU taken from the others' start-ups) until the slowest one got there.
        waiting = {name: run for name, run in runs.items() if name != "crash"}

        def fault_the_started() -> bool:
            for name, run in list(waiting.items()):
                if logged_steps(base / name / "run") >= 2:
                    assert run.proc.poll() is None, stderr_of(run.proc)[-3000:]
                    os.kill(rank_pid(run.proc.pid, run.target), signal.SIGKILL if name.startswith("killed")
                            else signal.SIGSTOP)
                    run.faulted_at = time.monotonic()
                    del waiting[name]
                else:
                    assert run.proc.poll() is None, f"{name} ended before step 2: {stderr_of(run.proc)[-3000:]}"
            return not waiting

        wait_until(fault_the_started, 240, "step 2 of every faulted run")
        for name, run in runs.items():
            run.stderr, _ = finish(run.proc, 300 if name == "crash" else TIMEOUT_S + 60)
            run.took = run.proc.ended_at - run.faulted_at  # timed by the waiter thread: the order here is free
    finally:
        for run in runs.values():
            if run.proc.poll() is None or pids_where(4, run.proc.pid):
                os.killpg(run.proc.pid, signal.SIGKILL)
    return runs


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_stopped_worker_is_named_first_within_timeout_plus_15s(faulted_runs, launcher):
    """Each launcher's run of `faulted_runs`: the stopped rank is named first, within parallel.timeout_s + 15 s."""
    run = faulted_runs[f"stopped under {launcher}"]
    at, line = first_named(run.proc)
    assert line.startswith(f"sluice: rank {run.target} stalled "), run.stderr[-3000:]
    assert "last heard" in line and "waiting on it" in line
    took = at - run.faulted_at
    print(f"{launcher}: rank {run.target} stopped, named after {took:.1f}s: {line}")  # the figure, with pytest -s
    assert took <= TIMEOUT_S + 15, f"{launcher}: named after {took:.1f}s: {line}"


def test_a_killed_worker_ends_the_run_before_any_timeout_under_torchrun(faulted_runs):
    """The death itself ends the run: well before parallel.timeout_s could (about 0.5 s on an idle machine; the
    bound is the timeout, so a loaded machine's slower teardown is no failure, a missed death still is)."""
    run = faulted_runs["killed under torchrun"]
    line = first_sluice_line(run.stderr)  # the agent may stop the survivors before they speak: its report names it
    named = line.startswith(f"sluice: rank {run.target} died") if line else \
        f"local_rank: {run.target}" in run.stderr and "Signal 9 (SIGKILL)" in run.stderr
    assert named, run.stderr[-3000:]
    print(f"torchrun: rank {run.target} killed, the run ended {run.took:.1f}s later: {line or 'torchrun named it'}")
    assert run.took < TIMEOUT_S, f"the run ended {run.took:.1f}s after the kill: it waited out parallel.timeout_s"


PP2 = LAUNCHERS["self-launch"][1]  # the restart is the launcher's, whatever the layout: two workers, not four


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from checkpoint.export import read_training_weights

    return read_training_weights(run_dir)[0]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Each step's loss in metrics.jsonl; a step run again after a restart keeps its last record."""
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_killed_worker_is_named_dead_at_once_and_the_restarted_run_is_bit_for_bit(tmp_path, data_cache):
    proc = start([sys.executable, "train.py"], [*PP2, *RESTARTS], tmp_path / "killed", data_cache)
    wait_until(lambda: logged_steps(tmp_path / "killed") >= 3 or proc.poll() is not None, 120, "step 3")
    os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    text, _ = finish(proc, 240)
    assert proc.returncode == 0, text[-3000:]
    said = [(at, part) for at, line in proc.lines for part in line.split("\r") if part.startswith("sluice: ")]
    at, line = next((at, line) for at, line in said if "restart 1 of 1" in line)
    # The launcher's word when it saw the death before a peer spoke, the heartbeats' (SIGKILL; last heard ...) when
    # the peer its reset socket woke was faster: the dead rank comes first, never a peer or its connection error.
    assert line.startswith("sluice: rank 1 died (SIGKILL"), text[-3000:]
    assert "; restart 1 of 1 from checkpoint step " in line, text[-3000:]
    print(f"self-launch: rank 1 killed, named {at - killed_at:.1f}s later: {line}")
    assert at - killed_at < 60, f"named {at - killed_at:.1f}s after the kill"  # timeout 300 s: the death named it
    # The same layout uninterrupted, in the session's pooled processes (no interpreter start-up): bit for bit.
    runs = [([*TINY, *PP2, *RESTARTS], str(tmp_path / "straight"))]
    straight = [by_rank[0] for by_rank in run_workers(layouts_worker, 2, runs, str(data_cache), timeout=300)]
    assert list(losses_by_step(tmp_path / "killed").values()) == straight[0]["losses"]
    mine, theirs = final_weights(tmp_path / "killed"), dense_params(straight)
    assert set(mine) - {"lm_head.weight"} == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    log = (tmp_path / "killed" / "train.log").read_text()  # rank 0 logged both attempts into one directory
    assert log.count("launching 2 local workers") == 1 and "restart: rank 1 died (SIGKILL" in log
    assert log.count("step 8 loss") == 1


def test_a_crash_that_comes_back_after_the_same_checkpoint_ends_the_run_in_one_line_each(faulted_runs):
    """The crash run of `faulted_runs` (self-launched dp2, train.max_restarts=1)."""
    run = faulted_runs["crash"]
    assert run.proc.returncode == 1, run.stderr[-3000:]
    crash = "sluice: rank 1: debug.fault: injected crash on rank 1 at step 5"
    assert sluice_lines(run.stderr) == [  # no traceback, the crashing rank's own words, not its peer's
        f"{crash}; restart 1 of 1 from checkpoint step 4",
        f"{crash} (the other workers were stopped; it failed 2 times after checkpoint step 4, more than "
        "train.max_restarts=1)"]
