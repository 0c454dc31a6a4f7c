"""The vocabulary of pipeline schedules: one Action = one kind of work on one micro-batch of one stage."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What an action does: compute (F, B, I, W) or move a boundary tensor (SEND_*/RECV_*)."""

    F = "F"  # forward
    B = "B"  # full backward (input grad and weight grad together)
    I = "I"  # backward for the input gradient only  # noqa: E741
    W = "W"  # backward for the weight gradient only (after I)
    SEND_F = "SEND_F"  # send this stage's output activation to the next stage
    RECV_F = "RECV_F"  # receive this stage's input activation from the previous stage
    SEND_B = "SEND_B"  # send the gradient of this stage's input to the previous stage
    RECV_B = "RECV_B"  # receive the gradient of this stage's output from the next stage

    @property
    def is_comm(self) -> bool:
        """True for SEND_*/RECV_*, which the lowering adds; schedules emit only compute."""
        return self.value.startswith(("SEND", "RECV"))


@dataclass(frozen=True)
class Action:
    """One unit of work: `kind` on micro-batch `microbatch` of stage `stage` (global stage index)."""

    kind: Kind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}@s{self.stage}"

    @staticmethod
    def parse(text: str, stage: int | None = None) -> Action:
        """Parse `F3@s1`, or `F3` with `stage` as default (the form used by CSV/JSON schedule tables)."""
        m = _ACTION_RE.fullmatch(text.strip())
        if m is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. 'F3@s1', 'B0', 'SEND_F2@s0'")
        kind, mb, st = m.group(1), int(m.group(2)), m.group(3)
        if st is None and stage is None:
            raise ValueError(f"action {text!r} names no stage; write it as '{text.strip()}@s<stage>'")
        return Action(Kind(kind), mb, int(st) if st is not None else stage)


# Longest kinds first, so that "SEND_F3" is not read as kind "S..." and "F3" is not taken from "SEND_F3".
_ACTION_RE = re.compile(r"(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:@s(\d+))?")

Schedule = list[list[Action]]  # one action list per pipeline rank, executed in order


@dataclass(frozen=True)
class Costs:
    """Durations of each action kind, in arbitrary time units, for lowering and simulation."""

    f: float = 1.0
    b: float = 2.0
    i: float = 1.0
    w: float = 1.0
    comm: float = 0.0  # one boundary-tensor transfer

    def of(self, kind: Kind) -> float:
        """Duration of one compute action of `kind`."""
        return {Kind.F: self.f, Kind.B: self.b, Kind.I: self.i, Kind.W: self.w}[kind]
