"""Fault injection, the non-finite policy, strict metrics and the hang summary, in process (no launcher)."""

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.reliability.hang import Watch, read_dumps, summarize
from parallel.pipeline.actions import Action
from training.reliability.faults import FaultInjector, InjectedCrash
from training.reliability.nonfinite import NonFiniteError, SkipPolicy, step_vote
from tests.equivalence import compose_run_config
from tests.spawn import run_workers


def test_crash_fires_on_its_rank_and_step_only():
    FaultInjector("crash@rank=1,step=3", rank=0).begin_step(3)  # another rank: nothing
    injector = FaultInjector("crash@rank=1,step=3", rank=1)
    injector.begin_step(2)
    with pytest.raises(InjectedCrash, match="rank 1 at step 3"):
        injector.begin_step(3)


def test_nan_poisons_loss_and_gradients_of_its_rank_and_step():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    injector = FaultInjector("nan@rank=0,step=2", rank=0)
    assert injector.poison(1, 1.5, [param]) == 1.5 and torch.isfinite(param.grad).all()
    assert math.isnan(injector.poison(2, 1.5, [param])) and torch.isnan(param.grad).all()


def test_stall_at_an_action_reports_itself_before_blocking(monkeypatch):
    seen = []
    injector = FaultInjector("stall@rank=0,step=2,action=F1@s1", rank=0, on_stall=seen.append)
    monkeypatch.setattr("threading.Event.wait", lambda self, timeout=None: True)  # do not block the test
    injector.begin_step(2)
    injector.before_action(Action.parse("F0@s1"))
    assert seen == []
    injector.before_action(Action.parse("F1@s1"))
    assert seen == ["a debug.fault stall (step 2, before F1@s1)"]
    FaultInjector("stall@rank=0,step=0", rank=0, on_stall=seen.append).start_up()
    assert seen[-1] == "a debug.fault stall (start-up, before joining the process group)"


def test_stop_names_the_step_and_what_was_non_finite():
    with pytest.raises(NonFiniteError, match="non-finite grad norm at step 7 .*train.on_nonfinite=stop"):
        SkipPolicy("stop", 3).should_step(7, step_vote(1.0, math.inf, 0, None, torch.device("cpu"))[0], 1.0, math.inf)
    assert step_vote(math.nan, math.nan, 0, None, torch.device("cpu"))[0] == "loss and grad norm"
    assert step_vote(1.0, 2.0, 3, None, torch.device("cpu")) == (None, 3, 2.0)


def test_skip_counts_and_stops_after_max_skipped_steps_in_a_row():
    policy = SkipPolicy("skip", 2)
    assert [policy.should_step(s, w, 0.0, 0.0) for s, w in [(1, "loss"), (2, None), (3, "loss"), (4, "loss")]] == [
        False, True, False, False]
    assert policy.skipped == 3
    with pytest.raises(NonFiniteError, match="3 steps in a row .*max_skipped_steps=2"):
        policy.should_step(5, "loss", math.nan, 0.0)


def test_hang_summary_names_the_stalled_rank_and_who_waits_for_whom(tmp_path):
    stalled, recv, coll = Watch(1, {"pp": 1}), Watch(0, {"pp": 0}), Watch(2, {"pp": 0}, {"dp": [2, 3]})
    stalled.enter("a debug.fault stall (step 2, before F0@s1)")
    recv.enter("waiting: rank 0: receiving gradient from rank 1 for micro-batch 0", [1])
    coll.collective("step 2: label-token all-reduce", "dp")
    for watch in (stalled, recv, coll):
        watch.run_dir = tmp_path
        watch.dump("timeout")
    lines = summarize(read_dumps(tmp_path), world_size=4)
    assert lines[0].startswith("rank 1 (pp=1) is the stalled rank: a debug.fault stall")
    assert "no dump from rank(s) [3]" in lines[1]
    assert any(line.startswith("rank 0 (pp=0): waiting") and "waits for rank(s) [1]" in line for line in lines)
    assert any(line.startswith("rank 2") and "over dp" in line and "waits for rank(s) [3]" in line for line in lines)


def test_a_timeout_seen_by_the_main_thread_and_the_watchdog_at_once_is_reported_once(tmp_path, capsys):
    """The rendezvous store times out in the main thread just as the watchdog's clock runs out (seen in CI)."""
    import threading

    from training.reliability.watchdog import Limits, report_hang

    watch = Watch(0)
    watch.run_dir = tmp_path
    watch.enter("start-up: joining the process group", [1], startup=True)
    barrier = threading.Barrier(8)

    def reporter():
        barrier.wait()
        report_hang(watch, Limits(10, 10), announce=True)

    threads = [threading.Thread(target=reporter) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert [d["rank"] for d in read_dumps(tmp_path)] == [0]
    assert sorted(p.name for p in (tmp_path / "hang").iterdir()) == ["rank0.json"]  # no stray temporary file
    assert capsys.readouterr().err.count("sluice: rank 0: no progress") == 1


def _skip_worker(rank: int, world_size: int, cache_dir: str, run_dir: str) -> dict:
    """dp=2: rank 1 alone gets NaN gradients at step 2 (after the DP sum); both ranks must skip that update, with whole
    parameters and with FSDP's shards (parallel.zero=3)."""
    from torch.distributed.tensor import DTensor

    from parallel.grid import ParallelGrid
    from training.trainer import Trainer

    grid = ParallelGrid.build(2, 1, 1, backend="gloo", timeout_s=60)
    out = {}
    for zero, (name, fault) in itertools.product((0, 3), (("skipped", "'nan@rank=1,step=2'"), ("reference", None))):
        overrides = ["model=tiny", "train.steps=3", "schedule.n_microbatches=2", "train.on_nonfinite=skip",
                     f"parallel.zero={zero}"]
        cfg = compose_run_config(overrides + ([f"debug.fault={fault}"] if fault else []), Path(cache_dir))
        trainer = Trainer(cfg, grid, Path(run_dir) / f"{name}-zero{zero}")
        steps: list[int] = []
        if fault is None:  # by construction: step 2's optimizer update never happens, data and LR move on
            real_step = trainer.optimizer.step
            trainer.optimizer.step = lambda: None if steps[-1] == 2 else real_step()
        trainer.fit(on_grads=steps.append)
        out[f"{name}-zero{zero}"] = {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                                     for k, p in trainer.engine.named_parameters().items()}
        out[f"{name}-zero{zero}_skipped"] = trainer.guard.skipped
    return out


def test_skip_equals_a_run_without_that_update_on_every_rank(tmp_path):
    for result in run_workers(_skip_worker, 2, str(tmp_path / "cache"), str(tmp_path / "run"), timeout=240):
        for zero in (0, 3):
            skipped, reference = result[f"skipped-zero{zero}"], result[f"reference-zero{zero}"]
            assert result[f"skipped-zero{zero}_skipped"] == 1 and result[f"reference-zero{zero}_skipped"] == 0
            assert skipped.keys() == reference.keys()
            assert all(torch.equal(skipped[k], reference[k]) for k in reference), zero
    for zero in (0, 3):
        rows = [json.loads(line) for line in (tmp_path / "run" / f"skipped-zero{zero}" / "metrics.jsonl").read_text()
                .splitlines()]
        assert [(r["step"], r["skipped_steps"]) for r in rows] == [(1, 0), (2, 1), (3, 1)]  # rank 0's finite loss


def test_known_errors_are_one_line_and_unexpected_ones_keep_their_traceback_in_the_rank_log(tmp_path):
    from parallel.pipeline.transport import TransportTimeout
    from training.reliability.failures import describe_failure

    assert describe_failure(TransportTimeout("rank 1: receiving\nactivation"), tmp_path, 1) == (
        "rank 1: receiving activation")
    assert describe_failure(InjectedCrash("boom"), tmp_path, 3) == "rank 3: boom"
    assert not (tmp_path / "logs").exists()
    try:
        {}["missing"]
    except KeyError as error:
        line = describe_failure(error, tmp_path, 2)
    log = tmp_path / "logs" / "rank2.log"
    assert line == f"rank 2: unexpected KeyError: 'missing' (traceback in {log})"
    assert log.read_text().startswith("Traceback") and "{}[\"missing\"]" in log.read_text()


def beat(rank: int, step: int, what: str, waits_for: list[int], blocked_s: float, age: float, pid: int | None = None):
    from training.reliability.heartbeat import Beat

    return Beat(rank, step, what, waits_for, blocked_s, time=1000.0 - age, pid=pid or os.getpid())


def test_the_heartbeats_name_the_rank_that_stopped_died_or_never_waited():
    from training.reliability.heartbeat import blame_line, find_culprit

    waiting = {r: beat(r, 7, "gradient all-reduce over dp", [2], 15.0, 0.5) for r in (0, 1, 3)}
    stopped = {**waiting, 2: beat(2, 7, "computing B3@s1", [], 0.2, 16.0)}
    culprit = find_culprit(stopped, 0, 1000.0, 4, waited_s=15.0)
    assert (culprit.rank, culprit.kind) == (2, "stopped")
    assert blame_line(culprit, stopped, 0) == ("rank 2 stalled at step 7 in computing B3@s1, last heard 16s ago; "
                                              "rank(s) 0, 1, 3 waiting on it")
    busy = {**waiting, 2: beat(2, 7, "a debug.fault stall (start of step 7)", [], 15.5, 0.3)}
    culprit = find_culprit(busy, 0, 1000.0, 4, waited_s=15.0)
    assert (culprit.rank, culprit.kind, culprit.line) == (2, "busy", "rank 2 stalled at step 7 in a debug.fault "
                                                                     "stall (start of step 7) for 16s")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = {**waiting, 2: beat(2, 7, "computing F1@s1", [], 0.1, 0.4, pid=gone.pid)}
    assert find_culprit(dead, 0, 1000.0, 4).line == "rank 2 died (its process is gone; last heard at step 7 in " \
                                                    "computing F1@s1)"
    pair = {r: beat(r, 7, "gradient all-reduce over dp", [1 - r], 15.0, 0.5) for r in (0, 1)}
    assert find_culprit(pair, 0, 1000.0, 2) is None  # everybody waits, nobody is late: the dumps must say
    assert find_culprit(waiting, 0, 1000.0, 4).line == "rank 2 never reported (stalled or died in start-up)"


def test_a_process_that_is_exiting_counts_as_gone_and_one_killed_by_a_signal_says_which():
    """A killed peer resets its sockets as it closes its files, before it is a zombie: the rank that reads its state
    on that reset must see it ending (the flags word's PF_EXITING), not running; and the signal that ends it (the
    exit_code field) tells the killed rank from the peers exiting after it."""
    from training.reliability.heartbeat import GONE, process_ending, stat_ending

    def stat(state: str, flags: int, exit_code: int) -> str:
        return f"4242 (a (b) c) {state} 1 4242 4242 0 -1 {flags} " + " ".join(["0"] * 42) + f" {exit_code}"

    running, exiting = stat("R", 4194560, 0), stat("R", 4194564, 9)
    assert [stat_ending(s) for s in (running, exiting, stat("Z", 4194560, 256), stat("Z", 4194560, 15))] == \
        [None, "SIGKILL", GONE, "SIGTERM"]
    assert stat_ending("4242 (old kernel) Z 1 4242 4242 0 -1 4194560 0 0") == GONE
    assert process_ending(os.getpid()) is None
    gone = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    gone.wait()
    assert process_ending(gone.pid) == GONE  # reaped: no word left on how


def test_heartbeats_travel_through_the_launchers_store():
    from datetime import timedelta

    import torch.distributed as dist

    from training.reliability.heartbeat import Heartbeats

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "TORCHELASTIC_RESTART_COUNT": "1"}
    links = [Heartbeats.connect(env, rank, 2) for rank in (0, 1)]
    links[1].publish(beat(1, 3, "computing F0@s1", [], 0.5, 0.0))
    assert list(links[0].read()) == [1] and links[0].read()[1].what == "computing F0@s1"
    assert Heartbeats.connect({**env, "TORCHELASTIC_RESTART_COUNT": "2"}, 0, 2).read() == {}  # a new attempt
    assert Heartbeats.connect({}, 0, 2) is None  # no launcher's store: no heartbeats, the dumps still work


WATCHDOG_AT_EXIT = """
import threading
from datetime import timedelta

import torch.distributed as dist

from training.reliability.hang import Watch
from training.reliability.watchdog import Limits, start_watchdog

server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
client.set("beat", "x")
ticking = threading.Event()


class BusyBeater:
    def tick(self, watch):  # a beat keeps the watchdog in C++ store calls, as a slow store would
        ticking.set()
        for _ in range(2000):
            client.get("beat")


watch = Watch(0)
watch.beater = BusyBeater()
watchdog = start_watchdog(watch, Limits(60, 60), announce=False)
ticking.wait(30)
watchdog.stop()
assert not watchdog.thread.is_alive()
"""


def test_a_worker_that_finished_exits_cleanly_while_its_watchdog_was_beating():
    """Seen in CI: a rank that trained to the end died of SIGABRT (`terminate called without an active exception`)
    because Python finalized while the daemon watchdog sat in a store call; the worker now stops it first."""
    result = subprocess.run([sys.executable, "-c", WATCHDOG_AT_EXIT], cwd=Path(__file__).parent.parent,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "terminate called" not in result.stderr, result.stderr[-2000:]
