"""Hang doctor, rank side: what this rank is doing or waiting for, and a JSON dump of it when it hangs.

`Watch` is a blackboard the step writes (cheap attribute stores, no locks: a reader may see a state one
action old, which is fine for a diagnosis) and the watchdog thread reads. `WatchedTransport` and
`WatchedSync` wrap the engine's transport and gradient sync to record P2P waits, compute actions and the
gradient all-reduces without the runtime knowing. `summarize` merges every rank's dump into the lines the
launcher prints: the stalled rank(s) first, then who waits for whom.
"""

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from checkpoint.atomic_write import write_text
from checkpoint.confine import read_small
from checkpoint.errors import CheckpointError
from parallel.pipeline.actions import Action
from parallel.pipeline.transport import SENDS, Message, Pending, describe, LocalTransport

DUMP_DIR = "hang"
RECORD_LIMIT = 1 << 20  # a dump or failure record is a few KB; larger is not one of ours


@dataclass
class State:
    """One blocking point: a description, the ranks it waits for (empty: not a wait) and when it began."""

    what: object  # a str, or an object whose str() says it (built only for a dump: the hot path stays cheap)
    waits_for: list[int] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)
    startup: bool = False  # a start-up wait (peers still importing and joining): bounded by its own timeout


class Watch:
    """This rank's current state, last completed action and posted transfers, for the watchdog to read."""

    def __init__(self, rank: int, coords: dict[str, int] | None = None, groups: dict[str, list[int]] | None = None):
        self.rank = rank
        self.coords = coords or {}
        self.groups = groups or {}  # group name ("dp", "pp", "mp", ...) -> its global ranks
        self.run_dir: Path | None = None  # where dumps go (under torchrun known only after the rendezvous)
        self.state = State("start-up")
        self.step = 0  # the 1-based training step under way (0: start-up), for the heartbeats
        self.beater = None  # training.reliability.heartbeat.Beater of a launched rank: publishes this watch, names culprits
        self.last_done: object = None  # like State.what: formatted only when dumped
        self.posted: list[tuple[int, Pending]] = []  # (sender/receiver rank, transfer) not known complete
        self.report_lock = threading.Lock()  # the main thread and the watchdog may both see the same timeout
        self.stop_lock = threading.Lock()  # the watchdog's signal and the step's vote may both set the interrupt
        self.reported = False
        self.interrupt = None  # the watchdog's Interrupt on SIGINT/SIGTERM: the loop saves after this step and stops

    def enter(self, what: object, waits_for: list[int] | None = None, startup: bool = False) -> None:
        """This rank now does (or waits for) `what`; the timeout clock restarts."""
        self.state = State(what, list(waits_for or []), startup=startup)

    def collective(self, what: str, *groups: str, startup: bool = False) -> None:
        """This rank now waits in a collective over `groups`: it waits for their other members."""
        peers = sorted({r for g in groups for r in self.groups.get(g, [])} - {self.rank})
        self.enter(f"{what} over {'+'.join(groups)}", peers, startup)

    def publish(self) -> None:
        """Tell the heartbeats this rank's state now (a new step or start-up phase) rather than at the next periodic
        beat: a rank frozen or killed a moment later is then described by what it was doing, not by a phase of a
        second ago (steps of a small model take a fraction of that)."""
        if self.beater is not None:
            self.beater.publish(self)

    def done(self, what: object) -> None:
        """`what` completed: progress."""
        self.last_done = what

    def blocked_s(self) -> float:
        """Seconds since the current state began."""
        return time.monotonic() - self.state.since

    def device_wait(self, older_than: float) -> State | None:
        """The oldest transfer this rank waited for in stream order (NCCL: the host went on, the device waits) that
        has not landed `older_than` seconds after: where this rank is really stuck, whatever its host does now."""
        now = time.monotonic()
        for rank, p in list(self.posted):
            awaited = getattr(p, "awaited_at", None)
            try:
                if awaited is not None and now - awaited > older_than and not p.ready():
                    return State(Waiting(rank, p.message), [p.message.peer], since=awaited)
            except Exception:  # a broken process group: the host side reports it
                return None
        return None

    def current(self, older_than: float = 1.0) -> State:
        """What this rank waits for now: a transfer the device waits for past `older_than`, else the host's state."""
        return self.device_wait(older_than) or self.state

    def pending(self) -> list[str]:
        """Posted sends and receives that have not completed."""
        out = []
        for rank, p in list(self.posted):
            try:
                if not p.ready():
                    out.append(describe(rank, p.message))
            except Exception:  # a broken process group: the transfer is as good as pending
                out.append(describe(rank, p.message))
        return out

    def dump(self, reason: str) -> Path | None:
        """Write `hang/rank{R}.json` into the run directory; return its path. None, writing nothing, while the run
        directory is not known (a torchrun rank >= 1 before rank 0 told it): never into the working directory."""
        if self.run_dir is None:
            return None
        path = Path(self.run_dir) / DUMP_DIR / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        state = asdict(self.state)
        state["blocked_s"] = round(self.blocked_s(), 1)
        state.pop("since")
        state["what"] = str(self.state.what)
        record = {"rank": self.rank, "pid": os.getpid(), "reason": reason, "coords": self.coords, **state,
                  "last_done": None if self.last_done is None else str(self.last_done), "pending": self.pending()}
        try:  # a temporary name per writer (two threads may dump at once), renamed: never half a dump
            write_text(path, json.dumps(record, indent=1), "hang dump")
        except CheckpointError:
            return None  # a link planted where the dump goes: nothing is written through it
        return path


@dataclass
class WatchedPending:
    """A posted transfer whose wait is recorded on the watch."""

    inner: Pending
    watch: Watch
    awaited_at: float | None = None  # when the runtime waited for it (the watchdog times one still in flight)

    @property
    def message(self) -> Message:
        return self.inner.message

    @property
    def tensor(self):
        return self.inner.tensor

    def ready(self) -> bool:
        return self.inner.ready()

    def wait(self) -> None:
        self.watch.enter(Waiting(self.watch.rank, self.message), [self.message.peer])
        self.inner.wait()  # under NCCL it returns at once: the device waits; Watch.device_wait times it
        if self.awaited_at is None:
            self.awaited_at = self.watch.state.since
        self.watch.done(Waited(self.message))


class WatchedTransport:
    """A Transport that records every wait and keeps the posted transfers for the dump."""

    def __init__(self, inner, watch: Watch):
        self.inner, self.watch = inner, watch

    def __getattr__(self, name: str) -> Any:  # what the runtime asks of a transport (e.g. receives_early)
        return getattr(self.inner, name)

    def post(self, messages: list[Message]) -> list[WatchedPending]:
        sends = [m for m in messages if m.action.kind in SENDS]
        if sends:  # a send can wait in post: a full shared-memory ring waits for the peer to take a message
            self.watch.enter(Waiting(self.watch.rank, sends[0]), [m.peer for m in sends])
        posted = [WatchedPending(p, self.watch) for p in self.inner.post(messages)]
        self.watch.posted = [(r, p) for r, p in self.watch.posted if not p.ready()]
        self.watch.posted += [(self.watch.rank, p) for p in posted]
        return posted


@dataclass(frozen=True)
class Computing:
    """A compute action in progress, said only when a dump asks (a string per action costs the hot path)."""

    action: Action
    suffix: str = ""

    def __str__(self) -> str:
        return f"computing {self.action}{self.suffix}"


@dataclass(frozen=True)
class Waiting:
    """A wait for one transfer, said only when a dump asks."""

    rank: int
    message: Message

    def __str__(self) -> str:
        return "waiting: " + describe(self.rank, self.message)


@dataclass(frozen=True)
class Waited:
    """A completed transfer, said only when a dump asks."""

    message: Message

    def __str__(self) -> str:
        return f"{self.message.action} with rank {self.message.peer}"


class WatchedSync:
    """The engine's gradient sync, recording compute actions (as its compute hooks) and the final sums."""

    def __init__(self, inner, watch: Watch, before_action=None):
        self.inner, self.watch = inner, watch
        self.before_action = before_action  # fault injection's hook (a stall at one action)
        self.tp_peers = sorted(set(watch.groups.get("tp", [])) - {watch.rank})

    def start_step(self) -> None:
        self.inner.start_step()

    def before(self, action: Action) -> None:
        if self.tp_peers:  # its TP collectives wait for the TP peers
            self.watch.enter(Computing(action, " (with TP collectives) over tp"), self.tp_peers)
        else:
            self.watch.enter(Computing(action))
        if self.before_action is not None:
            self.before_action(action)
        self.inner.before(action)

    def after(self, action: Action) -> None:
        self.inner.after(action)
        self.watch.done(action)

    def finish(self) -> None:
        self.watch.collective("gradient all-reduce", "dp", "embed")
        self.inner.finish()
        self.watch.done("gradient all-reduce")
        self.watch.collective("loss all-reduce", "pp", "dp")  # the engine's next wait

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def read_records(folder: Path, what: str, field: str, types: tuple[type, ...]) -> list[dict]:
    """The JSON objects of the `rank*.json` files in `folder` whose `field` has one of `types`, sorted by it."""
    records = []
    for path in Path(folder).glob("rank*.json"):
        try:  # a regular file of bounded size: a FIFO planted there would block the launcher's report
            record = json.loads(read_small(path, what, RECORD_LIMIT))
        except (CheckpointError, ValueError, RecursionError):
            continue
        if isinstance(record, dict) and type(record.get(field)) in types:
            records.append(record)
    return sorted(records, key=lambda r: r[field])


def read_dumps(run_dir: Path) -> list[dict]:
    """Every rank's dump in the run directory, by rank."""
    return read_records(Path(run_dir) / DUMP_DIR, "hang dump", "rank", (int,))


def summarize(dumps: list[dict], world_size: int) -> list[str]:
    """Lines naming the stalled rank(s) (not waiting for a peer) and every other rank's wait-for edge."""
    seen = {d["rank"] for d in dumps}
    stalled = [d for d in dumps if not d["waits_for"]]
    lines = [f"rank {d['rank']} {_coords(d)} is the stalled rank: {d['what']} for {d['blocked_s']}s "
             f"(last completed: {d['last_done']})" for d in stalled]
    missing = sorted(set(range(world_size)) - seen)
    if missing:
        lines.append(f"no dump from rank(s) {missing} (stalled or killed before they could write one)")
    same = {d["rank"]: d["what"] for d in dumps}
    for d in dumps:
        if d["waits_for"]:
            # In a collective, the ranks it waits for are the members that are not in the same collective.
            peers = [r for r in d["waits_for"] if same.get(r) != d["what"]] or d["waits_for"]
            on = f" -> waits for rank(s) {peers}"
            lines.append(f"rank {d['rank']} {_coords(d)}: {d['what']} for {d['blocked_s']}s{on}; last completed "
                         f"{d['last_done']}; pending {len(d['pending'])} transfer(s)")
    return lines


def _coords(dump: dict) -> str:
    c = dump.get("coords") or {}
    return "(" + ", ".join(f"{k}={v}" for k, v in c.items()) + ")" if c else ""


def watch_grid(watch: Watch, grid) -> None:
    """Record the rank's grid coordinates and the global ranks of each of its process groups."""
    import torch.distributed as dist

    watch.coords = {"pp": grid.pp_rank, "dp": grid.dp_rank, "tp": grid.tp_rank}
    for name in ("dp", "pp", "tp", "mp", "embed"):
        group = getattr(grid, f"{name}_group")
        watch.groups[name] = dist.get_process_group_ranks(group) if group is not None else [grid.rank]


def watch_engine(engine, watch: Watch, before_action=None) -> None:
    """Wrap a pipeline engine's transport (not the in-process one) and gradient sync so the watch sees every wait."""
    if not hasattr(engine, "sync"):
        return  # the single-device engine: nothing to wait for
    if not isinstance(engine.transport, LocalTransport):
        engine.transport = WatchedTransport(engine.transport, watch)
    engine.sync = WatchedSync(engine.sync, watch, before_action)
