"""Real faults: a worker stopped (SIGSTOP) or killed (SIGKILL) under self-launch and torchrun is named first, promptly;
train.max_restarts and torchrun's --max-restarts survive a kill bit for bit (whichever restarted rank arrives first),
train.max_restarts gives up on a fault that keeps coming back, and under torchrun every report lands in the run
directory (never the working directory), naming a stalled rank by the phase it is in."""

import contextlib
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
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.equivalence import dense_params, layouts_worker
from tests.shared import once_per_session
from tests.spawn import run_workers
from tests.test_reliability import TINY, pids_where, sluice_lines, wait_until

TORCHRUN = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--monitor-interval", "0.1",
            "--log-dir", "{tmp}/torchrun", "--nproc-per-node", "2"]  # its logs (else torchelastic_* in the temp folder)
TRAIN = str(ROOT / "train.py")  # absolute: the torchrun runs start in an empty working directory
LAUNCHERS = {  # launcher -> (command, layout, the rank to fault: its peer waits on it in P2P, or in a collective)
    "self-launch": ([sys.executable, TRAIN], ["parallel.pp=2"], 1),
    "torchrun": ([*TORCHRUN, TRAIN], ["parallel.dp=2"], 1),
}
# torchrun --max-restarts 1 through tests/late_rank_train.py: the killed rank 1 dies once rank 0 waits on it, and
# joins the restarted group after rank 0 entered the rendezvous (the order that read the dead rank's address from
# torchrun's store and failed, or hung, before each start had a store of its own). Its agent looks at the workers
# every 5 s, so rank 0, woken by its collective, names the death before the agent reaps the dead rank and stops rank 0
# (with rank 1 killed while rank 0 still computed and the agent at 0.1 s, the agent won in 1 of 3 runs here: no
# `sluice:` line at all). Rank 0 then ends by itself: the group still ends at once.
LATE_RANK = [*TORCHRUN[:3], "5", *TORCHRUN[4:], "--max-restarts", "1", str(ROOT / "tests" / "late_rank_train.py"),
             TRAIN]
RESUMED = ["parallel.dp=2", "train.steps=5", "checkpoint.every=1", "checkpoint.resume=auto", "optim.lr=1e-3"]
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


def workers_of(launchers: set[int]) -> dict[tuple[int, int], int]:
    """(launcher pid, rank) -> pid of each worker (named sluice-rank<R>) among the launchers' children: one pass over
    /proc for all of them (a pass costs milliseconds, polled five times a second)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if comm.startswith("sluice-rank") and int(fields[1]) in launchers:
            found[int(fields[1]), int(comm.removeprefix("sluice-rank"))] = int(entry.name)
    return found


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the worker of global `rank` among the launcher's children."""
    if (pid := workers_of({launcher_pid}).get((launcher_pid, rank))) is None:
        raise AssertionError(f"no worker of rank {rank} under pid {launcher_pid}")
    return pid


def running(pid: int) -> bool:
    """Whether process `pid` is there and neither stopped nor dead (a zombie its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "TtZX"


def launch(cmd: list[str], args: list[str], run_dir: Path, cache: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """A run in its own session; a thread keeps its stderr lines with their arrival times in `proc.lines` (a full
    pipe would block the run)."""
    cmd = [part.replace("{tmp}", str(run_dir.parent)) for part in cmd]
    proc = subprocess.Popen([*cmd, *TINY, *args, f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"],
                            cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "TMPDIR": str(TEMP)})
    proc.lines = []
    proc.reader = timed_lines(proc.stderr, proc.lines)
    return proc


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
        end_group(proc)
    took = time.monotonic() - began
    return stderr_of(proc), took


def end_group(proc: subprocess.Popen) -> None:
    """Kill what is left of a run: its launcher's session, and torchrun's workers (each in a session of its own)."""
    if proc.poll() is None or pids_where(4, proc.pid):
        for pid in [*pids_where(3, proc.pid), -proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # -pid: the launcher's process group


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
class Ended:
    """A run's launcher once it ended, as the tests read it: picklable, so one worker's runs serve the other's."""

    returncode: int
    lines: list[tuple[float, str]]  # its stderr lines with their arrival times (time.monotonic: one clock per host)


@dataclass
class Faulted:
    """A run of `faulted_runs`: its process and directories, its stderr once it ended, and when it was faulted and
    ended. `self_faulted`: debug.fault faults it (at the start of step 3), and the test watches ranks 0 and 1."""

    proc: subprocess.Popen | Ended
    target: int
    run_dir: Path
    cwd: Path
    self_faulted: bool = False
    stderr: str = ""
    faulted_at: float = math.inf
    group_ended_at: float = math.inf  # when the workers' group the fault hit was seen gone (its rank 0 ended)
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid of the first start's workers, once seen
    seen_running: float = -math.inf  # the last poll that saw the target rank running, before its fault


@pytest.fixture(scope="module")
def faulted_runs(tmp_path_factory, data_cache) -> dict[str, Faulted]:
    """`fault_runs`, once per session: pytest-xdist's work stealing may hand this module's tests to both workers."""
    return once_per_session(tmp_path_factory, "faulted-runs", lambda root: fault_runs(root, data_cache))


def fault_runs(base: Path, data_cache: Path) -> dict[str, Faulted]:
    """Five runs side by side, so that the suite waits once for their timeouts and start-ups: a worker stopped
    (SIGSTOP) under each launcher, a worker killed (SIGKILL) under torchrun --max-restarts 1, rank 0 stalled in
    start-up under torchrun, and a self-launched crash that comes back after its restart. Each is its own run in its
    own directory; only the waiting overlaps. The torchrun runs start in an empty working directory (rank 1 runs
    Hydra there: no report may land in it). Their rank 1 stops or kills itself (debug.fault) as step 3 begins (the
    killed one once rank 0 waits on it), so that one run serves both the timing of the named rank and the tests of
    the phase named, the reports' place and the bit-for-bit resume (each torchrun dp2 run costs some 20 CPU s of
    start-up). Only the self-launched run is stopped from here, at whatever point it is in once it logged step 2.
    A sixth, a self-launched pp2 run with train.max_restarts=1 whose rank 1 is killed from here at step 3, starts
    once the five are faulted: its start-up, restart and training overlap their timeouts and restarts."""
    long_run = ["train.steps=100000", f"parallel.timeout_s={TIMEOUT_S}"]
    self_launch, layout, _ = LAUNCHERS["self-launch"]
    plans = {  # name -> command, arguments, whether it starts in the repository root (else an empty directory)
        "stopped under self-launch": (self_launch, [*layout, *long_run], True),
        "stopped under torchrun": (LAUNCHERS["torchrun"][0], [*LAUNCHERS["torchrun"][1], *long_run,
                                                              "debug.fault='stop@rank=1,step=3'"], False),
        "killed under torchrun": (LATE_RANK, [*RESUMED, "debug.fault='kill@rank=1,step=3'"], False),
        "start-up": (LAUNCHERS["torchrun"][0], ["parallel.dp=2", "parallel.startup_timeout_s=10",
                                                "debug.fault='stall@rank=0,step=0'"], False),
        "crash": (self_launch, ["parallel.dp=2", *RESTARTS, CRASH], True),
    }
    runs = {}
    for name, (cmd, args, in_root) in plans.items():
        cwd, run_dir = ROOT if in_root else base / name / "cwd", base / name / "run"
        cwd.mkdir(parents=True, exist_ok=True)
        runs[name] = Faulted(launch(cmd, args, run_dir, data_cache, cwd), 1, run_dir, cwd,
                             self_faulted=name.endswith("under torchrun"))
    try:
        # The self-launched run is stopped as soon as it logged step 2, not once all have: a started run's workers
        # would otherwise train at full speed (CPU taken from the others' start-ups) until the slowest one got there.
        # A self-faulted run's fault time is the last poll that saw its rank 1 running (stopped: state T; killed: gone
        # or a zombie): the fault came after it, so each time measured from it is an upper bound of the real one (by
        # at most a poll, 0.2 s). A killed run's group (its first start) ended when its rank 0 did.
        waiting = {name: run for name, run in runs.items() if name.startswith(("stopped", "killed"))}

        def fault_the_started() -> bool:
            now = time.monotonic()  # before any look below: a state seen running was so at this moment or later
            unnamed = {run.proc.pid: run for run in waiting.values() if run.self_faulted and len(run.pids) < 2}
            for (launcher, rank), pid in (workers_of(set(unnamed)) if unnamed else {}).items():
                unnamed[launcher].pids.setdefault(rank, pid)
            for name, run in list(waiting.items()):
                if not run.self_faulted:
                    if logged_steps(run.run_dir) >= 2:
                        assert run.proc.poll() is None, stderr_of(run.proc)[-3000:]
                        os.kill(rank_pid(run.proc.pid, run.target), signal.SIGSTOP)
                        run.faulted_at = time.monotonic()
                        del waiting[name]
                    else:
                        assert run.proc.poll() is None, f"{name} ended before step 2: {stderr_of(run.proc)[-3000:]}"
                    continue
                if run.faulted_at == math.inf and len(run.pids) == 2:
                    if running(run.pids[run.target]):
                        run.seen_running = now
                    else:
                        assert run.seen_running > -math.inf, f"{name}: its rank 1 was never seen running"
                        run.faulted_at = run.seen_running
                elif run.faulted_at == math.inf:
                    assert run.proc.poll() is None, f"{name} ended before step 3: {stderr_of(run.proc)[-3000:]}"
                if run.faulted_at < math.inf and name.startswith("stopped"):
                    del waiting[name]
                elif run.faulted_at < math.inf and not running(run.pids[0]):
                    run.group_ended_at = time.monotonic()  # after the look: an upper bound too
                    del waiting[name]
            return not waiting

        wait_until(fault_the_started, 240, "the fault of every faulted run")
        # Then a self-launched worker killed from here at step 3, restarted by train.max_restarts: started once the
        # others are faulted (no start-up beside theirs, which their bounds time), it overlaps their waits instead.
        self_killed = runs["killed under self-launch"] = Faulted(
            launch(self_launch, [*layout, *RESTARTS], base / "killed under self-launch" / "run", data_cache), 1,
            base / "killed under self-launch" / "run", ROOT)

        def kill_at_step_3() -> bool:
            if logged_steps(self_killed.run_dir) < 3:
                assert self_killed.proc.poll() is None, f"ended before step 3: {stderr_of(self_killed.proc)[-3000:]}"
                return False
            os.kill(rank_pid(self_killed.proc.pid, self_killed.target), signal.SIGKILL)
            self_killed.faulted_at = time.monotonic()
            return True

        wait_until(kill_at_step_3, 240, "step 3 of the self-launched run to kill")
        for name, run in runs.items():
            run.stderr, _ = finish(run.proc, 300 if name in ("crash", "killed under torchrun", "start-up")
                                   else 240 if name == "killed under self-launch" else TIMEOUT_S + 60)
    finally:
        for run in runs.values():
            end_group(run.proc)
    for run in runs.values():
        run.proc = Ended(run.proc.returncode, run.proc.lines)
    return runs


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_stopped_worker_is_named_first_within_timeout_plus_15s(faulted_runs, launcher):
    """Each launcher's stopped run of `faulted_runs`: the stopped rank is named first, within parallel.timeout_s +
    15 s (self-launch: stopped from here once step 2 was logged; torchrun: it stopped itself as step 3 began)."""
    run = faulted_runs[f"stopped under {launcher}"]
    at, line = first_named(run.proc)
    assert line.startswith(f"sluice: rank {run.target} stalled "), run.stderr[-3000:]
    assert "last heard" in line and "waiting on it" in line
    took = at - run.faulted_at
    print(f"{launcher}: rank {run.target} stopped, named after {took:.1f}s: {line}")  # the figure, with pytest -s
    assert took <= TIMEOUT_S + 15, f"{launcher}: named after {took:.1f}s: {line}"


def test_a_rank_frozen_at_step_3_is_named_in_step_3(faulted_runs):
    """The stopped run under torchrun: its heartbeat said so as the step began, not a second later: the last
    periodic beat described start-up or an earlier step (steps of the tiny model take a fraction of a second). The
    run failed, and its reports are in the run directory, none in the working directory."""
    run = faulted_runs["stopped under torchrun"]
    assert run.proc.returncode != 0
    line = first_sluice_line(run.stderr)
    assert line.startswith("sluice: rank 1 stalled at step 3 in step 3: starting, last heard "), line
    assert list(run.cwd.iterdir()) == [] and (run.run_dir / "failures" / "rank0.json").exists()


def test_a_killed_worker_is_named_first_and_ends_its_group_before_any_timeout_under_torchrun(faulted_runs):
    """The killed run under torchrun (--max-restarts 1): the death itself is named first and ends the workers of that
    start, well before a timeout could (0.1-0.4 s here, loaded; the bound is the other runs' timeout, far below this
    run's parallel.timeout_s of 300 s: a loaded machine's slower teardown is no failure, a missed death still is)."""
    run = faulted_runs["killed under torchrun"]
    at, line = first_named(run.proc)
    assert line.startswith(f"sluice: rank {run.target} died (SIGKILL"), run.stderr[-3000:]
    named, ended = at - run.faulted_at, run.group_ended_at - run.faulted_at
    print(f"torchrun: rank {run.target} killed, named after {named:.1f}s, its group ended after {ended:.1f}s: {line}")
    assert named < TIMEOUT_S and ended < TIMEOUT_S, f"named after {named:.1f}s, the group ended after {ended:.1f}s"


def test_a_rank_killed_under_torchrun_max_restarts_resumes_bit_for_bit(faulted_runs, data_cache, tmp_path):
    """The killed run under torchrun: rank 1 is killed at step 3 (once rank 0 waits on it); in the restarted group it
    joins last, after rank 0 entered the rendezvous (tests/late_rank_train.py). Every report is in the run
    directory."""
    run = faulted_runs["killed under torchrun"]
    assert run.proc.returncode == 0, run.stderr[-3000:]
    assert "sluice: rank 1 died (SIGKILL" in run.stderr and "connectFullMesh" not in run.stderr
    assert list(run.cwd.iterdir()) == []
    log = (run.run_dir / "train.log").read_text()
    assert "resumed from" in log, log[-2000:]
    runs = [([*TINY, *RESUMED[:-2], RESUMED[-1]], str(tmp_path / "straight"))]  # the same run, uninterrupted
    straight = run_workers(layouts_worker, 2, runs, str(data_cache), timeout=300)[0][0]
    assert [loss for _, loss in sorted(losses_by_step(run.run_dir).items())] == straight["losses"]


def test_a_start_up_failure_under_torchrun_reports_into_the_run_directory_only(faulted_runs):
    run = faulted_runs["start-up"]
    assert run.proc.returncode != 0
    assert list(run.cwd.iterdir()) == []  # rank 1 ran Hydra here: before, its failures/ and hang/ landed here
    record = json.loads((run.run_dir / "failures" / "rank1.json").read_text())
    assert record["message"].startswith("rank 0 stalled in a debug.fault stall (start-up"), record
    assert "parallel.startup_timeout_s=10" in record["message"] and f"hang dump in {run.run_dir / 'hang'}" in \
        record["message"]
    assert json.loads((run.run_dir / "hang" / "rank1.json").read_text())["reason"] == "timeout"
    assert first_sluice_line(run.stderr) == f"sluice: {record['message']}"


PP2 = LAUNCHERS["self-launch"][1]  # the restart is the launcher's, whatever the layout: two workers, not four


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from checkpoint.export import read_training_weights

    return read_training_weights(run_dir)[0]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Each step's loss in metrics.jsonl; a step run again after a restart keeps its last record."""
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_killed_worker_is_named_dead_at_once_and_the_restarted_run_is_bit_for_bit(faulted_runs, tmp_path,
                                                                                      data_cache):
    """The self-launched pp2 run of `faulted_runs` whose rank 1 was killed from here once step 3 was logged."""
    run = faulted_runs["killed under self-launch"]
    text, killed_at = run.stderr, run.faulted_at
    assert run.proc.returncode == 0, text[-3000:]
    said = [(at, part) for at, line in run.proc.lines for part in line.split("\r") if part.startswith("sluice: ")]
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
    assert list(losses_by_step(run.run_dir).values()) == straight[0]["losses"]
    mine, theirs = final_weights(run.run_dir), dense_params(straight)
    assert set(mine) - {"lm_head.weight"} == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    log = (run.run_dir / "train.log").read_text()  # rank 0 logged both attempts into one directory
    assert log.count("launching 2 local workers") == 1 and "restart: rank 1 died (SIGKILL" in log
    assert log.count("step 8/8 loss") == 1


def test_a_crash_that_comes_back_after_the_same_checkpoint_ends_the_run_in_one_line_each(faulted_runs):
    """The crash run of `faulted_runs` (self-launched dp2, train.max_restarts=1)."""
    run = faulted_runs["crash"]
    assert run.proc.returncode == 1, run.stderr[-3000:]
    crash = "sluice: rank 1: debug.fault: injected crash on rank 1 at step 5"
    assert sluice_lines(run.stderr) == [  # no traceback, the crashing rank's own words, not its peer's
        f"{crash}; restart 1 of 1 from checkpoint step 4",
        f"{crash} (the other workers were stopped; it failed 2 times after checkpoint step 4, more than "
        "train.max_restarts=1)"]
