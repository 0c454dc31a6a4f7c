"""Fault injection for rehearsals and tests: `debug.fault=KIND@rank=R,step=S[,action=A]`.

KIND is one of
  crash  global rank R raises InjectedCrash at the start of step S (a known error: one line, exit 1);
  nan    global rank R's loss and every gradient it holds become NaN in step S, after the gradient sums,
         so the non-finite check sees a single bad rank (`train.on_nonfinite` decides what happens);
  stall  global rank R blocks forever (until killed) at the start of step S, or right before compute action
         A of step S (e.g. `action=F2@s1`); step 0 stalls during start-up, before the process group exists.
  sigint, sigterm  global rank R's process receives SIGINT (Ctrl-C) or SIGTERM (Slurm's preemption) at the start
         of step S; it counts as received in step S (the watchdog thread may take it a moment later).
  stop   global rank R's process stops itself (SIGSTOP: every thread frozen, as on a wedged host) at the start of
         step S; its heartbeats stop, and its peers name it and end it after parallel.timeout_s.
  kill   global rank R's process is killed (SIGKILL, as by the OOM killer) at the start of step S of the group's first
         start only: a group that torchrun --max-restarts started again runs on (a rehearsal of its recovery; under
         train.max_restarts every start is a first one, so the kill comes back, as a crash does).
A stall is what the hang doctor (`parallel.timeout_s`) must catch: every other rank times out, dumps where it
waits and the launcher names the stalled rank. Steps are 1-based, as in metrics.jsonl. On the command line
quote the value for Hydra: `python train.py parallel.pp=2 "debug.fault='stall@rank=1,step=3,action=F0@s1'"`.
"""

import math
import os
import signal
import threading
from dataclasses import dataclass

import torch

from parallel.pipeline.actions import Action

SIGNAL_FAULTS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM}
FAULT_KINDS = ("stall", "crash", "nan", "stop", "kill", *SIGNAL_FAULTS)
SYNTAX = "use stall|crash|nan|stop|kill|sigint|sigterm@rank=R,step=S[,action=A], e.g. stall@rank=1,step=3,action=F2@s1"


@dataclass(frozen=True)
class FaultSpec:
    """Which fault to inject where: on global rank `rank` at 1-based step `step` (0: start-up), maybe at one action."""

    kind: str
    rank: int
    step: int
    action: Action | None = None


def parse_fault(text: str) -> FaultSpec:
    """Parse a fault setting; raise ValueError with a one-line reason and the syntax."""
    kind, at, rest = str(text).strip().partition("@")
    if kind not in FAULT_KINDS or not at:
        raise ValueError(f"unknown fault {kind!r}; {SYNTAX}")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        name, eq, value = part.partition("=")
        if not eq or name.strip() not in ("rank", "step", "action") or name.strip() in fields:
            raise ValueError(f"cannot read {part!r}; {SYNTAX}")
        fields[name.strip()] = value.strip()
    if "rank" not in fields or "step" not in fields:
        raise ValueError(f"rank= and step= are both required; {SYNTAX}")
    try:
        rank, step = int(fields["rank"]), int(fields["step"])
    except ValueError:
        raise ValueError(f"rank and step must be integers; {SYNTAX}") from None
    if rank < 0 or step < 0:
        raise ValueError(f"rank must be >= 0 and step >= 0 (step 0: during start-up); {SYNTAX}")
    action = None
    if "action" in fields:
        try:
            action = Action.parse(fields["action"])
        except ValueError as error:
            raise ValueError(f"action: {error}") from None
    return FaultSpec(kind, rank, step, action)


class InjectedCrash(RuntimeError):
    """The crash that `debug.fault=crash@...` asked for."""


class FaultInjector:
    """Triggers the configured fault on its rank and step; every method is a no-op elsewhere."""

    def __init__(self, text: str | None, rank: int, on_stall=None):
        self.spec: FaultSpec | None = parse_fault(text) if text else None
        self.rank = rank
        self.on_stall = on_stall  # tells the hang doctor what this rank is (not) doing, before blocking
        self.step = 0
        self.signalled = 0  # the signal this rank sent itself (sigint/sigterm faults)

    def _here(self, kind: str, step: int) -> bool:
        spec = self.spec
        return spec is not None and spec.kind == kind and spec.rank == self.rank and spec.step == step

    def start_up(self) -> None:
        """Before the process group: a start-up stall."""
        if self._here("stall", 0):
            self._stall("start-up, before joining the process group")

    def begin_step(self, step: int) -> None:
        """At the start of 1-based step `step`: crash, or stall when no action was named."""
        self.step = step
        if self._here("crash", step):
            raise InjectedCrash(f"debug.fault: injected crash on rank {self.rank} at step {step}")
        if self._here("stop", step):
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._here("kill", step) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.spec is not None and self.spec.kind in SIGNAL_FAULTS and self._here(self.spec.kind, step):
            self.signalled = int(SIGNAL_FAULTS[self.spec.kind])
            os.kill(os.getpid(), self.signalled)
        if self._here("stall", step) and self.spec.action is None:
            self._stall(f"start of step {step}")

    def before_action(self, action: Action) -> None:
        """Before each compute action: the stall at `action=A`."""
        if self._here("stall", self.step) and self.spec.action == action:
            self._stall(f"step {self.step}, before {action}")

    def poison(self, step: int, loss: float, params: list[torch.nn.Parameter]) -> float:
        """After the gradient sums of step `step`: NaN gradients and loss on the faulted rank."""
        if not self._here("nan", step):
            return loss
        for param in params:
            if param.grad is not None:
                param.grad.fill_(math.nan)
        return math.nan

    def _stall(self, where: str) -> None:
        if self.on_stall is not None:
            self.on_stall(f"a debug.fault stall ({where})")
        threading.Event().wait()  # forever: the watchdog or the launcher ends this process
