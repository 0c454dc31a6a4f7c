"""A store of its own for each start of a launched group, and the run directory every rank learns from it.

torch's c10d rendezvous (torchrun, and our self-launch through its API) hands the workers the agent's own TCPStore,
and keeps that store across `--max-restarts`; the process group's keys name no attempt. A restarted rank then reads
the gloo address a dead rank of the previous attempt published, and fails ("Gloo connectFullMesh ... Connection
refused") or waits for a peer that never connects (a hang in init_process_group): the documented torchrun recovery
resumed in 1 of 7 tries. TORCHELASTIC_RESTART_COUNT cannot name the attempt either: each node counts only the
restarts it caused (pytorch/pytorch#135712). So global rank 0 of every start serves a new store on a free port and
announces it, with a fresh token, in the agent's store; a peer uses an announcement only once it has reached that
store and found the token in it: a stale announcement names a store that died with its rank 0 (or another one).
The same store tells every rank the run directory, so a rank >= 1 writes its reports there from its first second.
"""

import json
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

ANNOUNCEMENT = "sluice/attempt-store"  # in the agent's store: [host, port, token] of the newest start's store
TOKEN = "sluice/token"  # in a start's own store: the token its announcement carries
RUN_DIR = "sluice/run-dir"  # in a start's own store: rank 0's run directory
RETRY_S = 0.2  # between looks at the announcement, while rank 0 of this start has not made its store yet
CONNECT_S = 5.0  # to reach an announced store: one that died refuses at once, a busy host may take a moment


class StartupError(RuntimeError):
    """A rank could not join this start's store in time; the message names the wait and the setting."""


@dataclass(frozen=True)
class AttemptStore:
    """This start's own store (for init_process_group) and the run directory rank 0 announced in it."""

    store: dist.Store
    run_dir: str


def attempt_store(env: Mapping[str, str], run_dir: str, timeout_s: float) -> AttemptStore | None:
    """Rank 0 makes and announces this start's store; the others find it (within timeout_s). None without an agent
    store (a plain env:// launch, one process): the process group then rendezvouses as usual."""
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the launcher's own long-lived store (c10d)
    if world_size < 2 or not agent_store or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    host = env["MASTER_ADDR"]  # global rank 0 runs on the agent store's host: the first node holds ranks 0..n-1
    agent = dist.TCPStore(host, int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s))
    if rank == 0:
        return serve(agent, host, world_size, run_dir, timeout_s)
    return join(agent, rank, timeout_s)


def serve(agent: dist.Store, host: str, world_size: int, run_dir: str, timeout_s: float) -> AttemptStore:
    """Rank 0: a new store on a free port, holding the token and the run directory, then its announcement."""
    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    token = uuid.uuid4().hex
    store.set(TOKEN, token)
    store.set(RUN_DIR, run_dir)
    agent.set(ANNOUNCEMENT, json.dumps([host, store.port, token]))
    return AttemptStore(store, run_dir)


def join(agent: dist.Store, rank: int, timeout_s: float) -> AttemptStore:
    """A rank >= 1: the announced store once it answers with the announced token (a stale one never does)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if agent.check([ANNOUNCEMENT]):
            found = reach(*json.loads(agent.get(ANNOUNCEMENT)))
            if found is not None:
                found.store.set_timeout(timedelta(seconds=timeout_s))  # the process group's waits: start-up's bound
                return found
        time.sleep(RETRY_S)  # rank 0 of this start is still importing, or the announcement is the last start's
    raise StartupError(f"rank {rank}: rank 0 did not announce this start's store within {timeout_s:g}s "
                       "(parallel.startup_timeout_s); rank 0 died or stalled in start-up, see its output")


def reach(host: str, port: int, token: str) -> AttemptStore | None:
    """The store at host:port when it holds `token`, else None (gone, or another start's)."""
    try:  # a plain connection first: a store that is gone refuses it at once, where TCPStore retries and logs
        socket.create_connection((host, int(port)), timeout=CONNECT_S).close()
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=CONNECT_S))
        if store.check([TOKEN]) and store.get(TOKEN).decode() == token:
            return AttemptStore(store, store.get(RUN_DIR).decode())
    except (OSError, RuntimeError, ValueError):  # refused, reset or timed out: a store of an earlier start, gone
        return None
    return None
