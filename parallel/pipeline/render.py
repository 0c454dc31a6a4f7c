"""A simulated step as text: a rank x time grid of the compute actions, with bubble and memory."""

from __future__ import annotations

from .actions import Costs, Lists
from .simulate import SimResult, simulate


def step_text(
    lowered: Lists, pp: int, n_stages: int, n_microbatches: int, placement: str, costs: Costs | None = None,
    simulated: SimResult | None = None,
) -> str:
    """A rank x time grid of the compute actions (one column per time quantum), with bubble and memory.

    `simulated`: the step already simulated under `costs` (a large step need not be replayed twice)."""
    costs = costs or Costs()
    res = simulated or simulate(lowered, pp, n_stages, n_microbatches, placement, costs)
    quantum = min(c for c in (costs.f, costs.b, costs.i, costs.w, costs.comm) if c > 0)
    label = (lambda a: f"{a.kind.value}{a.microbatch}") if n_stages == pp else str
    width = 1 + max((len(label(a)) for actions in lowered for a in actions if not a.kind.is_comm), default=2)
    n_cols = round(res.makespan / quantum)
    lines = [
        f"pp={pp} stages={n_stages} micro-batches={n_microbatches} placement={placement}  "
        f"(F={costs.f:g} B={costs.b:g} I={costs.i:g} W={costs.w:g} comm={costs.comm:g}; "
        f"one column = {quantum:g}, '.' idle)"
    ]
    for r, actions in enumerate(lowered):
        cells = [".".ljust(width)] * n_cols
        for k, a in enumerate(actions):
            if a.kind.is_comm:
                continue
            c0, c1 = round(res.start[r][k] / quantum), round(res.end[r][k] / quantum)
            cells[c0] = label(a).ljust(width)
            for c in range(c0 + 1, c1):
                cells[c] = "-" * (width - 1) + " "
        lines.append(f"rank {r:<3}| " + "".join(cells).rstrip())
    lines.append(
        f"makespan {res.makespan:g}, bubble {res.bubble_fraction:.1%}, "
        f"peak live micro-batches per rank {res.peak_live}"
    )
    return "\n".join(lines)
