"""The vocabulary of pipeline schedules, and who talks to whom: one Action = one kind of work on one
micro-batch of one stage; a compute action's output goes to a neighbouring stage through a SEND/RECV pair."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from .partition import stage_to_rank


class Kind(str, Enum):
    """What an action does: compute (F, B, I, W) or move a boundary tensor (SEND_*/RECV_*)."""

    is_comm: bool  # True for SEND_*/RECV_*, which the lowering adds; schedules emit only compute

    def __new__(cls, value: str) -> Kind:
        member = str.__new__(cls, value)
        member._value_ = value
        # A plain attribute, not a property: the list checks read it about once per action (10^6 at scale).
        member.is_comm = value.startswith(("SEND", "RECV"))
        return member

    F = "F"  # forward
    B = "B"  # full backward (input grad and weight grad together)
    I = "I"  # backward for the input gradient only  # noqa: E741
    W = "W"  # backward for the weight gradient only (after I)
    SEND_F = "SEND_F"  # send this stage's output activation to the next stage
    RECV_F = "RECV_F"  # receive this stage's input activation from the previous stage
    SEND_B = "SEND_B"  # send the gradient of this stage's input to the previous stage
    RECV_B = "RECV_B"  # receive the gradient of this stage's output from the next stage
    # Generation: the last stage's sampled token goes back to the first stage, the input of the micro-batch's next
    # tick. Its other end is not a neighbouring stage, so MATES has no entry: `pipeline.generation` pairs them.
    SEND_T = "SEND_T"  # send the token a tick sampled (named by the tick's unit and the last stage)
    RECV_T = "RECV_T"  # receive the token a tick starts from (named by that tick's unit and the first stage)


F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741
SEND_F, RECV_F, SEND_B, RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
SEND_T, RECV_T = Kind.SEND_T, Kind.RECV_T


class Action(NamedTuple):
    """One unit of work: `kind` on micro-batch `microbatch` of stage `stage` (global stage index).

    A named tuple rather than a dataclass: the list checks build, hash and compare about 10^6 of them at
    pp=64, and a tuple does that in C (a plain `(kind, mb, stage)` tuple is the same dictionary key)."""

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
_ACTION_RE = re.compile(r"(SEND_F|RECV_F|SEND_B|RECV_B|SEND_T|RECV_T|F|B|I|W)(\d+)(?:@s(\d+))?")

Schedule = list[list[Action]]  # one action list per pipeline rank, executed in order
Lists = Sequence[Sequence[Action]]  # the same, read-only (a LoweredPipeline's lists are tuples)


@dataclass(frozen=True)
class Costs:
    """Durations of each action kind, in arbitrary time units, for lowering and simulation.

    The scalars hold for every stage; a non-empty `stage_*` tuple (one entry per global stage) overrides its
    kind per stage, and `stage_comm` (one entry per boundary s -> s+1) overrides `comm` per boundary."""

    f: float = 1.0
    b: float = 2.0
    i: float = 1.0
    w: float = 1.0
    comm: float = 0.0  # one boundary-tensor transfer
    stage_f: tuple[float, ...] = ()
    stage_b: tuple[float, ...] = ()
    stage_i: tuple[float, ...] = ()
    stage_w: tuple[float, ...] = ()
    stage_comm: tuple[float, ...] = ()

    def of(self, kind: Kind, stage: int | None = None) -> float:
        """Duration of one compute action of `kind` (on `stage`, where per-stage durations are given)."""
        per_stage = self._per_stage()[kind]
        return per_stage[stage] if per_stage and stage is not None else self.durations()[kind]

    def durations(self) -> dict[Kind, float]:
        """Duration of each compute kind (hot loops look them up here rather than call `of`)."""
        return {F: self.f, B: self.b, I: self.i, W: self.w}

    def stage_durations(self, n_stages: int) -> dict[Kind, list[float]]:
        """Duration of each compute kind on each of `n_stages` stages (the replay's lookup table)."""
        scalar, per_stage = self.durations(), self._per_stage()
        table = {}
        for kind, values in per_stage.items():
            if values and len(values) != n_stages:
                raise ValueError(f"Costs has {len(values)} per-stage {kind.value} durations for {n_stages} stages")
            table[kind] = list(values) if values else [scalar[kind]] * n_stages
        return table

    def boundary_comm(self, n_stages: int) -> list[float]:
        """Transfer time across each boundary s -> s+1 (n_stages - 1 entries)."""
        if not self.stage_comm:
            return [self.comm] * max(n_stages - 1, 0)
        if len(self.stage_comm) != n_stages - 1:
            raise ValueError(f"Costs has {len(self.stage_comm)} boundary comm times for {n_stages} stages")
        return list(self.stage_comm)

    def _per_stage(self) -> dict[Kind, tuple[float, ...]]:
        return {F: self.stage_f, B: self.stage_b, I: self.stage_i, W: self.stage_w}


# --- Who talks to whom. ---------------------------------------------------------------------------------
# The *_of functions answer with plain `(kind, microbatch, stage)` tuples: equal to the Action, the same
# dictionary key, and cheaper to build in the checks' loops over every action; the rest wrap them.

Key = tuple  # (Kind, microbatch, stage): an Action's fields as a plain tuple


def input_of(action: Key, n_stages: int) -> Key | None:
    """The RECV naming a compute action's input from a neighbouring stage (local or not), if it has one."""
    kind, mb, s = action
    if kind is F:
        return (RECV_F, mb, s) if s > 0 else None
    if kind is B or kind is I:
        return (RECV_B, mb, s) if s < n_stages - 1 else None
    return None


def output_of(action: Key, n_stages: int) -> Key | None:
    """The RECV that takes a compute action's output to the neighbouring stage, if it has one."""
    kind, mb, s = action
    if kind is F:
        return (RECV_F, mb, s + 1) if s < n_stages - 1 else None
    if kind is B or kind is I:  # I produces the input gradient just as B does
        return (RECV_B, mb, s - 1) if s > 0 else None
    return None


# The rule of `mate_of`, as data: a comm kind -> the kind at the other end and that end's stage offset.
# (The replays read it directly: a function call per message is a tenth of their time at pp=64.)
MATES = {SEND_F: (RECV_F, 1), RECV_F: (SEND_F, -1), SEND_B: (RECV_B, -1), RECV_B: (SEND_B, 1)}


def mate_of(action: Key) -> Key:
    """The comm action on the other end: SEND_F(m, s) <-> RECV_F(m, s+1), SEND_B(m, s) <-> RECV_B(m, s-1)."""
    kind, mb, s = action
    mate = MATES.get(kind)
    if mate is None:
        raise ValueError(f"{Action._make(action)} is a compute action; only SEND_*/RECV_* have a counterpart")
    return mate[0], mb, s + mate[1]


def needs(action: Action, n_stages: int) -> Action | None:
    """The RECV that names a compute action's input from a neighbouring stage (local or not), if any."""
    key = input_of(action, n_stages)
    return None if key is None else Action._make(key)


def counterpart(action: Action) -> Action:
    """The comm action on the other end of a SEND_*/RECV_* (see `mate_of`)."""
    return Action._make(mate_of(action))


def comm_peer(action: Action, n_stages: int, placement: str, pp: int) -> int:
    """The pipeline rank a SEND_*/RECV_* action talks to."""
    stage = mate_of(action)[2]
    if not 0 <= stage < n_stages:
        raise ValueError(f"{action} talks to stage {stage}, which does not exist ({n_stages} stages)")
    return stage_to_rank(stage, pp, placement)
