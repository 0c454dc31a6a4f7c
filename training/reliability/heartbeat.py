"""Heartbeats: each launched rank says once a second, in the launcher's store, what it is doing.

A rank that times out waiting cannot tell from its own state who stopped: it waits for its pipeline neighbour,
which waits for its DP peer, which may be the one that stalled. The heartbeats of every rank answer that at
once: a rank whose heartbeat stopped (stopped by SIGSTOP, dead, wedged in C with its threads frozen) or that
has been busy with local work all along is the culprit; the ranks whose beats say "waiting" are its victims.
The launcher's store is the one place every rank can reach under self-launch and torchrun alike; each rank
opens its own client connection so a beat never waits behind the process group's store traffic.

A beat's age is judged by the store's clock, never by another host's: every beat takes the next value of one counter
in the store, so the store orders all beats, and a reader dates a peer's beat by its own beats around it, on its own
monotonic clock. Hosts whose wall clocks disagree by minutes are judged alike.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import timedelta

PERIOD_S = 1.0  # one beat a second: cheap for the store, fresh enough for a timeout of seconds
STALE_S = 5.0  # a beat older than this: its rank stopped (a live watchdog thread beats every PERIOD_S)
KEY = "sluice/heartbeat/"
OWN_BEATS = 4096  # this rank's own beats remembered to date others' (over an hour at one a second)


@dataclass
class Beat:
    """One rank's last word: where it is, since when, and how to reach its process on its host."""

    rank: int
    step: int
    what: str
    waits_for: list[int]
    blocked_s: float
    time: float = 0.0  # when the reader last knew it fresh, on the reader's monotonic clock (dated by `tick`)
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    tick: int = 0  # the store's clock when it was published: the order of every rank's beats

    def age(self, now: float) -> float:
        return now - self.time


@dataclass(frozen=True)
class Culprit:
    """The rank that stopped the group, one line saying how, and where its process runs."""

    rank: int
    kind: str  # "died", "stopped" (its beats stopped: it cannot end itself), "busy" (local work), "silent"
    line: str
    pid: int = 0
    host: str = ""


class Heartbeats:
    """This rank's beats out, every rank's beats in, over a client of the launcher's store."""

    def __init__(self, store, rank: int, world_size: int, attempt: str = "0", clock=time.monotonic):
        self.store, self.rank, self.world_size, self.clock = store, rank, world_size, clock
        self.prefix = f"{KEY}{attempt}/"  # torchrun keeps its store across --max-restarts: no stale beats
        self.own: deque[tuple[int, float]] = deque(maxlen=OWN_BEATS)  # (store tick, this host's clock) of our beats

    @classmethod
    def connect(cls, env: dict, rank: int, world_size: int, timeout_s: float = 2.0) -> Heartbeats | None:
        """A client of the store at MASTER_ADDR:MASTER_PORT (set by torchrun and our self-launch), or None."""
        import torch.distributed as dist

        host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not host or not port or world_size < 2:
            return None
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
        except Exception:  # noqa: BLE001  no store to reach: the hang dumps still name the stalled rank
            return None
        return cls(store, rank, world_size, env.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def publish(self, beat: Beat) -> None:
        beat.tick = self.store.add(f"{self.prefix}clock", 1)
        self.store.set(f"{self.prefix}{self.rank}", json.dumps(asdict(beat)))
        self.own.append((beat.tick, self.clock()))

    def read(self) -> dict[int, Beat]:
        """The last beat of every rank that has published one, its `time` set on this host's clock (`heard`)."""
        beats = {}
        for rank in range(self.world_size):
            key = f"{self.prefix}{rank}"
            if self.store.check([key]):
                beats[rank] = Beat(**json.loads(self.store.get(key)))
                beats[rank].time = self.heard(beats[rank].tick)
        return beats

    def heard(self, tick: int) -> float:
        """When a beat published at store tick `tick` was last known fresh, on this host's clock: at the first of our
        own beats after it (it was published before that one: its age is at least that long); now when we have not
        beaten since. A lower bound, never more than a beat period off: a live rank is never taken for stopped."""
        for own_tick, at in list(self.own):  # a copy: the other thread may beat meanwhile
            if own_tick > tick:
                return at
        return self.clock()


PF_EXITING = 0x4  # include/linux/sched.h: set on every thread as it starts to exit, before its files close
GONE = "its process is gone"


def stat_ending(stat: str) -> str | None:
    """How the process of a /proc/<pid>/stat line ends: the signal that kills it (`SIGKILL`), GONE when it exits on
    its own, None while it runs. A zombie, a dead process and one exiting all count: a killed rank resets its peers'
    sockets as it closes its files, before it turns zombie, so the peer that reads its state at once sees it still
    running, but already exiting."""
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces and parentheses
    if fields[0] not in ("Z", "X") and not int(fields[6]) & PF_EXITING:
        return None
    code = int(fields[49]) if len(fields) > 49 else 0  # exit_code (Linux 3.5+): the status waitpid will report
    if not code & 0x7F:
        return GONE  # an exit of its own: often a peer ending because the culprit did
    try:
        return signal.Signals(code & 0x7F).name
    except ValueError:
        return f"signal {code & 0x7F}"


def process_ending(pid: int) -> str | None:
    """How process `pid` on this host ended or is ending (see stat_ending), None while it runs."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat_ending(stat.read())
    except FileNotFoundError:
        return GONE
    except OSError:  # no /proc (not Linux): ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return GONE
        except PermissionError:
            return None
        return None


def _at(beat: Beat) -> str:
    return f"at step {beat.step} in {beat.what}" if beat.step else f"in {beat.what}"


def find_culprit(beats: dict[int, Beat], me: int, now: float, world_size: int, waited_s: float = 0.0
                 ) -> Culprit | None:
    """The rank that stopped progressing, judged from every rank's last beat (`now` on the clock of their `time`); None
    when the beats cannot say. In order: a rank whose process is gone (this host), a rank whose beats stopped (the
    oldest), a rank busy with local work rather than waiting for a peer (the longest, and for about as long as `me` has
    waited)."""
    here = socket.gethostname()
    others = [b for r, b in sorted(beats.items()) if r != me]
    # A rank killed by a signal before one that exits on its own: its peers exit too (their launcher stops them,
    # or they fail on its reset sockets), and a peer slow to look can find several ranks gone.
    endings = {b.rank: process_ending(b.pid) for b in others if b.host == here}
    dead = sorted((b for b in others if endings.get(b.rank)), key=lambda b: endings[b.rank] == GONE)
    stale = sorted((b for b in others if b.age(now) > STALE_S), key=lambda b: b.time)
    busy = sorted((b for b in others if not b.waits_for), key=lambda b: -b.blocked_s)
    if dead:
        b = dead[0]
        return Culprit(b.rank, "died", f"rank {b.rank} died ({endings[b.rank]}; last heard {_at(b)})", b.pid, b.host)
    if stale:
        b = stale[0]
        return Culprit(b.rank, "stopped", f"rank {b.rank} stalled {_at(b)}, last heard {b.age(now):.0f}s ago",
                       b.pid, b.host)
    if busy and busy[0].blocked_s >= min(STALE_S, waited_s / 2):
        b = busy[0]
        return Culprit(b.rank, "busy", f"rank {b.rank} stalled {_at(b)} for {b.blocked_s:.0f}s", b.pid, b.host)
    silent = sorted(set(range(world_size)) - set(beats) - {me})
    if silent and beats:
        return Culprit(silent[0], "silent", f"rank {silent[0]} never reported (stalled or died in start-up)")
    return None


def blame_line(culprit: Culprit, beats: dict[int, Beat], me: int) -> str:
    """`culprit`'s line and the ranks waiting on it ("rank 2 stalled ...; rank(s) 0, 1, 3 waiting on it")."""
    waiting = sorted({r for r, b in beats.items() if b.waits_for and r != culprit.rank} | {me} - {culprit.rank})
    return f"{culprit.line}; rank(s) {', '.join(map(str, waiting))} waiting on it"


def end_stopped(culprit: Culprit) -> None:
    """SIGKILL a culprit whose beats stopped, when it runs on this host: a stopped process ignores the launcher's
    SIGTERM, and the launcher would wait its grace period (30 s in torchrun's agent) before killing it."""
    if culprit.kind == "stopped" and culprit.pid and culprit.host == socket.gethostname():
        try:
            os.kill(culprit.pid, signal.SIGKILL)
        except OSError:
            pass  # ended already


class Beater:
    """Publishes a Watch's state every PERIOD_S from the watchdog thread; connects lazily, gives up quietly."""

    ATTEMPTS = 3

    def __init__(self, env: dict, rank: int, world_size: int):
        self.env, self.rank, self.world_size = env, rank, world_size
        self.link: Heartbeats | None = None
        self.attempts, self.next_try, self.next_beat, self.next_look = 0, 0.0, 0.0, 0.0
        self.lock = threading.Lock()  # the watchdog's periodic beats and the main thread's Watch.publish
        self.prompt = True  # the main thread publishes too, until the store fails it once (it must not wait on it)

    def tick(self, watch) -> None:
        now = time.monotonic()
        if self.link is None and self.attempts < self.ATTEMPTS and now >= self.next_try:
            self.attempts += 1
            self.link = Heartbeats.connect(self.env, self.rank, self.world_size)
            self.next_try = now + 5.0
        if self.link is not None and now >= self.next_beat:
            self._beat(watch)

    def publish(self, watch) -> None:
        """A beat now, from the main thread (a new step or phase), once the watchdog has connected."""
        if self.link is not None and self.prompt and not self._beat(watch):
            self.prompt = False

    def _beat(self, watch) -> bool:
        """Publish `watch`'s state; False when the store did not take it (the launcher is ending the group)."""
        with self.lock:
            self.next_beat = time.monotonic() + PERIOD_S
            state = watch.current()  # a transfer the device is stuck in (NCCL) is what this rank waits for
            try:
                self.link.publish(Beat(self.rank, watch.step, str(state.what), list(state.waits_for),
                                       round(time.monotonic() - state.since, 1)))
            except Exception:  # noqa: BLE001  the store went away
                return False
            return True

    def stopped_peer(self, rank: int, waited_s: float) -> bool:
        """Whether a peer's beats stopped (a frozen process), asked at most once per STALE_S (every rank's beat is
        read): for a rank in local work that has gone on for long, which a collective inside it may be waiting on. Not
        a peer that died: its launcher sees that and stops the group (a report here would only race its SIGTERM)."""
        now = time.monotonic()
        if now < self.next_look:
            return False
        self.next_look = now + STALE_S
        blamed = self.blame(rank, waited_s)
        return blamed is not None and blamed[0].kind == "stopped"

    def blame(self, rank: int, waited_s: float = 0.0, dead_only: bool = False) -> tuple[Culprit, str] | None:
        """The culprit and its blame line as this rank sees the beats now, or None."""
        if self.link is None:
            return None
        try:
            beats = self.link.read()
        except Exception:  # noqa: BLE001  the store is gone: no verdict from the beats
            return None
        culprit = find_culprit(beats, rank, self.link.clock(), self.world_size, waited_s)
        if culprit is None or (dead_only and culprit.kind != "died"):
            return None
        return culprit, blame_line(culprit, beats, rank)
