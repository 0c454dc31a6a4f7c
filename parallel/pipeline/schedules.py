"""Schedules as data: generators of per-rank compute actions and their registry.

A generator is `(pp, n_microbatches, vpp) -> Schedule` and emits compute actions only (F/B, or F/I/W);
`lowering.lower` adds the SEND_*/RECV_* a runtime executes, `lowered.lower_pipeline` loads, lowers and checks.
A generator runs only for a layout its registry entry accepts (checked once, by `load_schedule`). Adding one is its
generator and its entry here: config presets, tests and benchmarks read the registry.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from .actions import Action, Kind, Schedule

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


# --- Generators: rank r of a single-chunk schedule runs stage r. -----------------------------------------


def gpipe(pp: int, n_microbatches: int, vpp: int = 1) -> Schedule:
    """All forwards, then all backwards, both in micro-batch order (as torch's ScheduleGPipe)."""
    m = n_microbatches
    return [[Action(F, i, r) for i in range(m)] + [Action(B, i, r) for i in range(m)] for r in range(pp)]


def one_f_one_b(pp: int, n_microbatches: int, vpp: int = 1) -> Schedule:
    """1F1B: warm-up forwards, then alternate one forward and one backward, then drain the backwards."""
    m = n_microbatches
    # Rank r has pp-r-1 forwards in flight before the first backward comes back to it.
    return [_one_f_one_b([Action(F, i, r) for i in range(m)], [Action(B, i, r) for i in range(m)], pp - r - 1)
            for r in range(pp)]


def interleaved_1f1b(pp: int, n_microbatches: int, vpp: int) -> Schedule:
    """Megatron's interleaved 1F1B: vpp stages per rank (looped: laps), micro-batches in groups of pp, depth first."""
    m = n_microbatches

    def unit(k: int, r: int, backward: bool) -> tuple[int, int]:
        """(micro-batch, stage) of rank r's k-th forward or backward: a group of pp micro-batches runs
        through lap 0, then lap 1, ... (backwards: last lap first) before the next group starts."""
        group, i = divmod(k, pp * vpp)
        lap = vpp - 1 - i // pp if backward else i // pp
        return group * pp + i % pp, lap * pp + r

    schedule = []
    for r in range(pp):
        forwards = [Action(F, *unit(k, r, False)) for k in range(m * vpp)]
        backwards = [Action(B, *unit(k, r, True)) for k in range(m * vpp)]
        # Warm up through every lap but the last for one whole group, plus two per hop to the last rank
        # (Megatron's count; one would do at zero comm cost, the second hides a transfer's latency).
        schedule.append(_one_f_one_b(forwards, backwards, (vpp - 1) * pp + 2 * (pp - r - 1)))
    return schedule


def zb_h1(pp: int, n_microbatches: int, vpp: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into I and W, and rank r's W's deferred by r steps."""
    m, schedule = n_microbatches, []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        actions = [Action(F, i, r) for i in range(warmup)]
        deferred = iter(range(m))  # W's in micro-batch order
        for i in range(m):
            if warmup + i < m:
                actions.append(Action(F, warmup + i, r))
            actions.append(Action(I, i, r))
            # Gradients now travel at the speed of I, so rank r runs out of I's r steps before rank 0 does;
            # holding r W's back fills exactly that tail, and keeps at most pp micro-batches (1F1B's peak) live.
            if i >= r:
                actions.append(Action(W, next(deferred), r))
        actions += [Action(W, i, r) for i in deferred]
        schedule.append(actions)
    return schedule


def zbv(pp: int, n_microbatches: int, vpp: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2023, sec. 6): two chunks per rank in a V, split backward; 1F1B's memory, ~no bubble."""
    m = n_microbatches
    n = max(m, 2 * pp - 1)  # schedule a full pipeline, then drop the micro-batches that do not exist
    schedule = []
    for r in range(pp):
        down, up = r, 2 * pp - 1 - r  # lap 0 on the way down the V, lap 1 on the way back up
        count = {(kind, s): 0 for kind in (F, I, W) for s in (down, up)}
        actions: list[Action] = []

        def run(*steps: tuple[Kind, int]) -> None:
            for kind, s in steps:
                actions.append(Action(kind, count[kind, s], s))
                count[kind, s] += 1

        run(*[(F, down)] * (2 * (pp - r) - 1))  # warm-up: enough forwards to reach the bottom of the V
        for _ in range(r):
            run((F, up), (F, down))
        for _ in range(pp - r):
            run((F, up), (I, up), (W, up))
        while count[F, up] < n:  # steady state: F, I, W of each lap in turn
            if count[F, down] < n:
                run((F, down))
            run((I, down), (W, down), (F, up), (I, up), (W, up))
        for _ in range(r):  # cool-down: I's first, they are on the critical path; W's fill in behind
            run((I, down), (I, up))
        for _ in range(pp - r):
            run((I, down), (W, down))
        run(*[(W, up)] * (n - count[W, up]), *[(W, down)] * (n - count[W, down]))
        schedule.append([a for a in actions if a.microbatch < m])
    return schedule


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward at a time, then the remaining backwards."""
    warmup = min(warmup, len(forwards))
    steady = [a for pair in zip(forwards[warmup:], backwards) for a in pair]
    return forwards[:warmup] + steady + backwards[len(forwards) - warmup:]


@dataclass(frozen=True)
class RegisteredSchedule:
    """A generator and the layouts it runs: stage placement, chunks per rank (vpp), micro-batch multiple, preset."""

    generate: Callable[[int, int, int], Schedule]
    placement: str = "loop"  # loop: stage s on rank s % pp; v: rank r holds stages r and 2pp-1-r
    vpp: tuple[int, int | None] = (1, 1)  # chunks per rank it accepts: (least, most or None); the least is default
    microbatches_multiple_of_pp: bool = False  # schedule.n_microbatches must be a multiple of parallel.pp
    n_microbatches: int | None = None  # what the `schedule=<name>` preset sets (None: the schema's default)
    # torch.distributed.pipelining's class of the same schedule, by name: what the benchmarks run it against
    # (None: torch has none). Named here, so a new schedule's entry says it; torch itself is not imported.
    torch_schedule: str | None = None

    @property
    def default_vpp(self) -> int:
        return self.vpp[0]

    def check(self, name: str, pp: int, n_microbatches: int, vpp: int) -> None:
        """Raise ValueError naming the key to change when this schedule cannot run the layout."""
        least, most = self.vpp
        if vpp < least or most is not None and vpp > most:
            span = str(least) if least == most else f"{least} or more" if most is None else f"{least} to {most}"
            fix = f"={least}" if least == most else f">={least}" if vpp < least else f"<={most}"
            raise ValueError(f"schedule {name!r} runs {span} stage{'s' * (span != '1')} per rank; "
                             f"set parallel.vpp{fix} (got {vpp})")
        if self.microbatches_multiple_of_pp and n_microbatches % pp:
            raise ValueError(
                f"schedule {name!r} needs schedule.n_microbatches to be a multiple of parallel.pp (got "
                f"{n_microbatches} and {pp}); set schedule.n_microbatches={-(-n_microbatches // pp) * pp}")


SCHEDULES: dict[str, RegisteredSchedule] = {
    "gpipe": RegisteredSchedule(gpipe, torch_schedule="ScheduleGPipe"),
    "1f1b": RegisteredSchedule(one_f_one_b, torch_schedule="Schedule1F1B"),
    "interleaved-1f1b": RegisteredSchedule(interleaved_1f1b, vpp=(2, None), microbatches_multiple_of_pp=True,
                                           n_microbatches=8, torch_schedule="ScheduleInterleaved1F1B"),
    # ZB-H1 is ZB1P on one stage per rank, which torch runs as its interleaved zero-bubble schedule.
    "zb-h1": RegisteredSchedule(zb_h1, n_microbatches=8, torch_schedule="ScheduleInterleavedZeroBubble"),
    "zbv": RegisteredSchedule(zbv, placement="v", vpp=(2, 2), n_microbatches=8, torch_schedule="ScheduleZBVZeroBubble"),
}


def find_schedule(name: str) -> RegisteredSchedule:
    """A registered schedule by name, or one outside the core named `package.module:attribute` (schedule.module):
    a RegisteredSchedule, or a bare generator (loop placement, one stage per rank)."""
    if name in SCHEDULES:
        return SCHEDULES[name]
    if name == "module":
        raise ValueError("schedule=module needs schedule.module=<package.module:function> (a schedule generator)")
    if ":" not in name:
        raise ValueError(f"schedule.name={name} is not a known schedule; use one of {', '.join(sorted(SCHEDULES))}, "
                         "table with schedule.path=<file>, or module with schedule.module=<package.module:function>")
    try:
        found = pkgutil.resolve_name(name)
    except Exception as error:  # the user's module: a failure to import it or a missing name, said in one line
        reason = (str(error) or repr(error)).strip().splitlines()[0]
        raise ValueError(f"schedule.module={name}: cannot load it ({reason}); check the name and that its folder is "
                         "on PYTHONPATH") from None
    if isinstance(found, RegisteredSchedule):
        return found
    if not callable(found):
        raise ValueError(f"schedule.module={name} is not a function; name a schedule generator (pp, n_microbatches, "
                         "vpp) -> per-rank lists of actions")
    return RegisteredSchedule(found)
