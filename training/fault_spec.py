"""`debug.fault`: the fault-injection setting, parsed once (`stall|crash|nan@rank=R,step=S[,action=A]`)."""

from dataclasses import dataclass

from parallel.pipeline.actions import Action

FAULT_KINDS = ("stall", "crash", "nan")
SYNTAX = "use stall|crash|nan@rank=R,step=S[,action=A], e.g. stall@rank=1,step=3,action=F2@s1"


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
