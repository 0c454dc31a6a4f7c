"""The README's "Writing a schedule" example, kept as a module outside the core (`schedule.module=` loads it)."""

from parallel.pipeline.actions import Action, Kind


def one_f_one_b_late_w(pp: int, n_microbatches: int, vpp: int = 1) -> list[list[Action]]:
    """1F1B with the backward split: I at once (it unblocks the rank before), every W at the very end."""
    m, schedule = n_microbatches, []
    for r in range(pp):  # rank r runs stage r
        warmup = min(pp - r - 1, m)  # forwards in flight before the first gradient comes back
        actions = [Action(Kind.F, i, r) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                actions.append(Action(Kind.F, warmup + i, r))
            actions.append(Action(Kind.I, i, r))
        actions += [Action(Kind.W, i, r) for i in range(m)]  # weight grads fill the tail; memory stays held
        schedule.append(actions)
    return schedule
