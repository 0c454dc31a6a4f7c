"""`torchrun ... tests/late_rank_train.py train.py OVERRIDES`: train.py, except for the order of two events, each made
certain rather than left to the machine's load.

- Rank 1 of a restarted group joins only once rank 0 is in the rendezvous, as a replaced node or a slow import makes
  it arrive last. That order is the one that failed: torchrun keeps its store across --max-restarts, and a restarted
  rank 0 that looks first reads the gloo address its dead peer published in the previous start ("Gloo
  connectFullMesh ... Connection refused").
- In the first start, a rank that debug.fault kills at the start of a step dies only once rank 0 waits on it in that
  step (its heartbeat says so): rank 0 then learns of the death from its own collective at once and names it, before
  torchrun's agent could reap the dead rank and stop rank 0 mid-sentence (a rank still computing when its peer died
  could lose that race on a loaded machine)."""

import json
import os
import runpy
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOINING = "start-up: joining the process group"  # rank 0's phase in its heartbeat (training/launch/workers.py)


def rank_0_beat(store, restart: str) -> dict | None:
    """Rank 0's last heartbeat of this start (training/reliability/heartbeat.py), or None before its first."""
    key = f"sluice/heartbeat/{restart}/0"
    return json.loads(store.get(key)) if store.check([key]) else None


def kill_once_rank_0_waits(store) -> None:
    """Delay debug.fault's kill of this rank until rank 0's heartbeat says it waits on this rank in that step."""
    from training.reliability.faults import FaultInjector

    begin_step = FaultInjector.begin_step

    def begin_step_once_waited_on(self, step: int) -> None:
        deadline = time.monotonic() + 60  # a bound, not a pace: rank 0 beats once a second
        while self._here("kill", step) and time.monotonic() < deadline and not (
                (beat := rank_0_beat(store, "0")) and beat["step"] == step and self.rank in beat["waits_for"]):
            time.sleep(0.05)
        begin_step(self, step)

    FaultInjector.begin_step = begin_step_once_waited_on


if __name__ == "__main__":
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("RANK", "0") != "0":
        import torch.distributed as dist

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=60))
        if restart == "0":
            sys.path.insert(0, str(ROOT))
            kill_once_rank_0_waits(store)
        elif os.environ["RANK"] == "1":
            deadline = time.monotonic() + 120  # a bound, not a pace: the wait ends when rank 0 says it is joining
            while time.monotonic() < deadline and not ((beat := rank_0_beat(store, restart)) and
                                                       beat["what"] == JOINING):
                time.sleep(0.1)
    sys.path.insert(0, str(ROOT))
    sys.argv = sys.argv[1:]  # train.py and its overrides, as torchrun would have started them
    runpy.run_path(sys.argv[0], run_name="__main__")
