"""A watchdog thread per launched worker: bounded waits, no orphans, quiet signals.

Every 0.2 s it checks three things and ends the process itself (os._exit: the main thread may be stuck in
a C call that never returns, and it must not print a traceback per rank):
- the launcher died (the parent pid changed): exit at once, so no worker outlives its torchrun agent or
  self-launching root (polling works whatever the launcher is; PR_SET_PDEATHSIG follows the parent *thread*);
- this rank has waited for peers (P2P, a collective) longer than parallel.timeout_s (during start-up, while peers
  still import and join: parallel.startup_timeout_s): write the hang dump and a one-line failure, exit 1; local work
  is not timed (its peers time out waiting for it), but see `_peer_stopped` and `_device_stuck`;
- SIGTERM / SIGINT arrived: their Python handlers do nothing, and the C-level handler writes the signal
  number to a wakeup socket this thread selects on, so it acts even while the main thread sits in a C call
  (a blocked sigmask does not work: torch starts threads at import that would take the signal). The first one
  during training asks the ranks to save after the step (`Interrupt`); `_on_signal` says when it ends the process.
"""

import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from training.reliability import flight_recorder
from training.reliability.hang import Watch
from training.reliability.heartbeat import end_stopped
from training.reliability.failures import FAILURE_DIR, record_failure

POLL_S = 0.2
EXIT_INTERRUPTED = 130
SIGNALS = {signal.SIGTERM, signal.SIGINT}
# The same signal again this soon is the same request delivered twice: Slurm signals every process of a job step
# and torchrun's agent forwards its own copy to the workers a moment later.
REPEAT_S = 2.0
MTIME_SLACK_S = 0.1


def exit_code(signo: int) -> int:
    """The shell's exit status of a process ended by `signo`: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signo


@dataclass
class Interrupt:
    """A stop asked by SIGINT/SIGTERM: the loop saves after the step in flight (`saving` once it began); `own`:
    this rank received the signal (not only learned of it in the ranks' vote); `repeats`: copies of the same request
    taken as one (delivered twice, or this rank's own copy after the vote's)."""

    signo: int
    at: float = field(default_factory=time.monotonic)
    saving: bool = False
    own: bool = True
    repeats: int = 0

    @property
    def name(self) -> str:
        return signal.Signals(self.signo).name


class Interrupted(KeyboardInterrupt):
    """Raised by the loop once an interrupted run saved (or said why not): the process exits with `code`."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def route_signals() -> tuple[socket.socket, socket.socket, dict]:
    """Route SIGTERM/SIGINT to the watchdog; returns the wakeup socket pair and the handlers they replace. Only the
    main thread may: from another (a launcher running jobs in threads) the signals stay as they are."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    if threading.current_thread() is not threading.main_thread():
        return reader, writer, {}
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous = {signo: signal.signal(signo, lambda *_: None) for signo in SIGNALS}  # the watchdog acts; the main
    return reader, writer, previous  # thread must not raise or die


@dataclass(frozen=True)
class Limits:
    """How long a rank may wait for its peers: after start-up, and during it."""

    timeout_s: float
    startup_timeout_s: float

    def of(self, watch: Watch) -> tuple[float, str]:
        """The bound of the wait `watch` is in now, and the key that sets it."""
        if watch.state.startup:
            return self.startup_timeout_s, "parallel.startup_timeout_s"
        return self.timeout_s, "parallel.timeout_s"

    def exceeded(self, watch: Watch, share: float = 1.0) -> bool:
        """`watch` waits for peers and has waited longer than `share` of its bound."""
        return bool(watch.state.waits_for) and watch.blocked_s() > share * self.of(watch)[0]


@dataclass
class Watchdog:
    """The running watchdog thread; `stop` ends it before the interpreter does."""

    thread: threading.Thread
    stopping: threading.Event
    previous: dict  # signal -> the handler before route_signals (SIG_DFL in a worker, KeyboardInterrupt in Python)

    def stop(self) -> None:
        """End the thread and wait for it. A daemon thread still inside a C++ call (a store beat) when Python
        finalizes is ended by pthread_exit, which C++ turns into `terminate called without an active exception`
        and SIGABRT: a run that trained to the end would exit as a crash."""
        self.stopping.set()
        self.thread.join(timeout=10 * POLL_S)
        if self.previous:  # from here on SIGTERM/SIGINT act as before (call in the main thread)
            signal.set_wakeup_fd(-1)
        for signo, handler in self.previous.items():
            signal.signal(signo, handler)


def start_watchdog(watch: Watch, limits: Limits, announce: bool, follow_launcher: bool = True) -> Watchdog:
    """Start the daemon thread watching `watch`; `announce` also prints failures (no launcher of ours);
    `follow_launcher` ends this process when its parent dies (a launched worker, not a one-process run)."""
    *sockets, previous = route_signals()
    stopping = threading.Event()
    parent = os.getppid() if follow_launcher else None
    # Failure records older than this are an earlier run's. Taken here, not in the thread (which may start late:
    # a peer's record written meanwhile would look old), and a little early: a file's time comes from the kernel's
    # coarse clock, up to a tick behind time.time().
    started = time.time() - MTIME_SLACK_S
    thread = threading.Thread(target=_loop, args=(watch, limits, parent, announce, sockets, stopping, started),
                              name="sluice-watchdog", daemon=True)
    thread.start()
    return Watchdog(thread, stopping, previous)


def _loop(watch: Watch, limits: Limits, parent: int | None, announce: bool, sockets: list,
          stopping: threading.Event, started: float) -> None:
    reader = sockets[0]  # the pair stays referenced here: closing the writer would silence the signals
    while not stopping.is_set():
        if select.select([reader], [], [], POLL_S)[0]:
            for signo in reader.recv(64):
                if signo in SIGNALS:
                    _on_signal(watch, signo, started, alone=parent is None)
        if parent is not None and os.getppid() != parent:
            os._exit(1)  # the launcher is gone: nobody will collect this rank's result
        if watch.beater is not None:
            watch.beater.tick(watch)
        if limits.exceeded(watch) or _device_stuck(watch, limits) or _peer_stopped(watch, limits):
            report_hang(watch, limits, announce)
            sys.stderr.flush()
            os._exit(1)
        interrupt = watch.interrupt
        if interrupt is not None and not interrupt.saving and time.monotonic() - interrupt.at > limits.timeout_s:
            _say(watch, f"interrupted by {interrupt.name}: step {watch.step} did not end within "
                        f"parallel.timeout_s={limits.timeout_s:g}; nothing was saved")
            os._exit(exit_code(interrupt.signo))


def _device_stuck(watch: Watch, limits: Limits) -> bool:
    """A transfer the device waits for in stream order (NCCL) has not landed within parallel.timeout_s: that is the
    hang, reported as this rank's wait (the host, gone on, would block later somewhere else, under another name)."""
    stuck = watch.device_wait(limits.timeout_s)
    if stuck is None:
        return False
    watch.state = stuck
    return True


def _peer_stopped(watch: Watch, limits: Limits) -> bool:
    """Local work (not timed: a slow save is no hang) past parallel.timeout_s while a peer stopped (its beats did): a
    collective inside that work (a checkpoint save's) would wait for it forever, and no launcher sees a frozen
    process, so it is reported as a wait."""
    return (watch.beater is not None and not watch.state.waits_for and not watch.state.startup
            and watch.blocked_s() > limits.timeout_s and watch.beater.stopped_peer(watch.rank, watch.blocked_s()))


def _on_signal(watch: Watch, signo: int, started: float, alone: bool) -> None:
    """A first signal during training asks for a stop with a checkpoint; anything else ends the process now
    (`alone`: a one-process run, which says so; a launcher reports for its workers)."""
    interrupt = watch.interrupt
    if interrupt is None and watch.step > 0 and not _peers_failed(watch, started):
        step = watch.step
        if claim_stop(watch, Interrupt(signo)):
            # The ranks agree on the stop in a step's vote: a signal that lands after this step's vote stops the next.
            _say(watch, f"{signal.Signals(signo).name}: stopping after step {step}, or step {step + 1} if step {step} "
                        "is already ending; send it again to stop at once")
            return
        interrupt = watch.interrupt  # a vote told this rank first: its own copy is the same request, below
    if interrupt is not None and signo == interrupt.signo and (
            not interrupt.own or time.monotonic() - interrupt.at < REPEAT_S):
        interrupt.own = True  # the request the ranks agreed on reaching this rank too, or delivered twice (Slurm
        interrupt.repeats += 1  # signals every process of a job step, and torchrun's agent forwards its own copy)
        return
    if signo == signal.SIGTERM and watch.blocked_s() > 1.0 and interrupt is None:
        watch.dump("terminated")  # stopped while blocked: part of another rank's hang report
    if alone:
        _say(watch, f"interrupted by {signal.Signals(signo).name} "
                    + (f"again in step {watch.step}: stopped at once, nothing saved" if interrupt else "in start-up"))
    os._exit(exit_code(signo))


def claim_stop(watch: Watch, interrupt: Interrupt) -> bool:
    """Record `interrupt` as this rank's stop unless one is recorded already (the watchdog's own signal and the
    main thread's vote may both learn of it at once); True when this call recorded it, and so announces it."""
    with watch.stop_lock:
        if watch.interrupt is not None:
            return False
        watch.interrupt = interrupt
        return True


def announce_agreed_stop(watch: Watch, signo: int, step: int) -> None:
    """Rank 0's notice of a stop it learned in `step`'s vote: only another rank got the signal, or rank 0's own copy
    comes later (a loaded machine may schedule its watchdog late). Exact: the stop comes after this step."""
    _say(watch, f"{signal.Signals(signo).name}: stopping after step {step}; send it again to stop at once")


def _peers_failed(watch: Watch, started: float) -> bool:
    """A peer failed (its failure record) or died (the heartbeats): the signal is the launcher stopping the
    survivors, whose next collective would only wait for the dead."""
    if watch.run_dir is not None:
        try:
            if any(p.stat().st_mtime >= started for p in (Path(watch.run_dir) / FAILURE_DIR).glob("rank*.json")):
                return True
        except OSError:
            pass  # a record removed while looked at: the heartbeats still tell
    return watch.beater is not None and watch.beater.blame(watch.rank, dead_only=True) is not None


def _say(watch: Watch, message: str) -> None:
    """Rank 0 prints a `sluice:` line (through tqdm: a progress bar on the screen is cleared first)."""
    if watch.rank == 0:
        tqdm.write(f"sluice: {message}", file=sys.stderr)
        sys.stderr.flush()


def report_hang(watch: Watch, limits: Limits, announce: bool) -> None:
    """Dump where this rank waits and leave the one-line failure naming it (once per rank)."""
    with watch.report_lock:  # a store timeout in the main thread and the watchdog's own can coincide
        if watch.reported:
            return
        watch.reported = True
        path = watch.dump("timeout")  # None while the run directory is not known (a torchrun rank >= 1 in start-up)
        flight_recorder.dump(watch.run_dir, watch.rank)  # NCCL's own record of the ops in flight, beside it
        bound, key = limits.of(watch)
        message = (f"rank {watch.rank}: no progress for {watch.blocked_s():.0f}s ({key}={bound:g}) "
                   f"in: {watch.state.what}" + (f"; hang dump in {path.parent}" if path else ""))
        blamed = watch.beater.blame(watch.rank, watch.blocked_s()) if watch.beater is not None else None
        if blamed is None:
            record_failure(watch.run_dir, watch.rank, message, announce)
            return
        culprit, line = blamed  # the heartbeats name who stopped: that comes first, this rank's wait after it
        record_failure(watch.run_dir, watch.rank, f"{line} ({message})", announce, culprit.rank, culprit.kind)
        end_stopped(culprit)
