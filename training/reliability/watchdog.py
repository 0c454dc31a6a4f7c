"""A watchdog thread per launched worker: bounded waits, no orphans, quiet signals.

Every 0.2 s it checks three things and ends the process itself (os._exit: the main thread may be stuck in
a C call that never returns, and it must not print a traceback per rank):
- the launcher died (the parent pid changed): exit at once, so no worker outlives its torchrun agent or
  self-launching root (polling works whatever the launcher is; PR_SET_PDEATHSIG follows the parent *thread*);
- this rank has waited for peers (P2P, a collective) longer than parallel.timeout_s, or during start-up (peers
  still importing and joining) longer than parallel.startup_timeout_s: write the hang dump and a one-line
  failure, exit 1 (local work is not timed: its peers time out waiting for it);
- SIGTERM / SIGINT arrived: their Python handlers do nothing, and the C-level handler writes the signal
  number to a wakeup socket this thread selects on, so it acts even while the main thread sits in a C call
  (a blocked sigmask does not work: torch starts threads at import that would take the signal). SIGTERM (the
  launcher stopping the workers after another rank failed) writes a dump if this rank was blocked.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
from dataclasses import dataclass

from training.reliability.hang import Watch
from training.reliability.heartbeat import end_stopped
from training.reliability.failures import record_failure

POLL_S = 0.2
EXIT_INTERRUPTED = 130
SIGNALS = {signal.SIGTERM, signal.SIGINT}


def route_signals() -> tuple[socket.socket, socket.socket]:
    """Route SIGTERM/SIGINT to the watchdog (call in the main thread); returns the wakeup socket pair."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    for signo in SIGNALS:
        signal.signal(signo, lambda *_: None)  # the watchdog acts; the main thread must not raise or die
    return reader, writer


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

    def stop(self) -> None:
        """End the thread and wait for it. A daemon thread still inside a C++ call (a store beat) when Python
        finalizes is ended by pthread_exit, which C++ turns into `terminate called without an active exception`
        and SIGABRT: a run that trained to the end would exit as a crash."""
        self.stopping.set()
        self.thread.join(timeout=10 * POLL_S)
        signal.set_wakeup_fd(-1)  # from here on SIGTERM/SIGINT end the process as usual (call in the main thread)
        for signo in SIGNALS:
            signal.signal(signo, signal.SIG_DFL)


def start_watchdog(watch: Watch, limits: Limits, announce: bool) -> Watchdog:
    """Start the daemon thread watching `watch`; `announce` also prints failures (no launcher of ours)."""
    sockets = route_signals()
    stopping = threading.Event()
    thread = threading.Thread(target=_loop, args=(watch, limits, os.getppid(), announce, sockets, stopping),
                              name="sluice-watchdog", daemon=True)
    thread.start()
    return Watchdog(thread, stopping)


def _loop(watch: Watch, limits: Limits, parent: int, announce: bool, sockets: tuple,
          stopping: threading.Event) -> None:
    reader = sockets[0]  # the pair stays referenced here: closing the writer would silence the signals
    while not stopping.is_set():
        if select.select([reader], [], [], POLL_S)[0]:
            for signo in reader.recv(64):
                if signo in SIGNALS:
                    _on_signal(watch, signo)
        if os.getppid() != parent:
            os._exit(1)  # the launcher is gone: nobody will collect this rank's result
        if watch.beater is not None:
            watch.beater.tick(watch)
        if limits.exceeded(watch):
            report_hang(watch, limits, announce)
            sys.stderr.flush()
            os._exit(1)


def _on_signal(watch: Watch, signo: int) -> None:
    if signo == signal.SIGTERM and watch.blocked_s() > 1.0:
        watch.dump("terminated")  # stopped while blocked: part of another rank's hang report
    os._exit(EXIT_INTERRUPTED if signo == signal.SIGINT else 128 + signo)


def report_hang(watch: Watch, limits: Limits, announce: bool) -> None:
    """Dump where this rank waits and leave the one-line failure naming it (once per rank)."""
    with watch.report_lock:  # a store timeout in the main thread and the watchdog's own can coincide
        if watch.reported:
            return
        watch.reported = True
        _report(watch, limits, announce)


def _report(watch: Watch, limits: Limits, announce: bool) -> None:
    path = watch.dump("timeout")  # None while the run directory is not known (a torchrun rank >= 1 in start-up)
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
