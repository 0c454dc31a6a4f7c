"""Schedules as data: generators of per-rank compute actions, their registry, and the lowering that adds P2P.

A generator is `(pp, n_microbatches, vpp) -> Schedule` and emits compute actions only (F/B, or F/I/W).
`lower` turns that into the list a runtime executes, with SEND_*/RECV_* placed so that, under the
runtime's batched blocking P2P (a run of consecutive comm actions is one `batch_isend_irecv` that waits for
all of its ops), no schedule whose compute order is feasible can deadlock.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .actions import Action, Costs, Kind, Schedule
from .partition import stage_to_rank

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


# --- Generators: rank r of a single-chunk schedule runs stage r. -----------------------------------------


def gpipe(pp: int, n_microbatches: int, vpp: int = 1) -> Schedule:
    """All forwards, then all backwards, both in micro-batch order (as torch's ScheduleGPipe)."""
    _one_chunk("gpipe", vpp)
    m = n_microbatches
    return [[Action(F, i, r) for i in range(m)] + [Action(B, i, r) for i in range(m)] for r in range(pp)]


def one_f_one_b(pp: int, n_microbatches: int, vpp: int = 1) -> Schedule:
    """1F1B: warm-up forwards, then alternate one forward and one backward, then drain the backwards."""
    _one_chunk("1f1b", vpp)
    m = n_microbatches
    # Rank r has pp-r-1 forwards in flight before the first backward comes back to it.
    return [_one_f_one_b([Action(F, i, r) for i in range(m)], [Action(B, i, r) for i in range(m)], pp - r - 1)
            for r in range(pp)]


def interleaved_1f1b(pp: int, n_microbatches: int, vpp: int) -> Schedule:
    """Megatron's interleaved 1F1B: vpp chunks per rank (looped), micro-batches in groups of pp, depth first."""
    if vpp < 2:
        raise ValueError(f"schedule 'interleaved-1f1b' needs virtual stages; set parallel.vpp>=2 (got {vpp})")
    m = n_microbatches
    if m % pp:
        raise ValueError(
            f"schedule 'interleaved-1f1b' needs schedule.n_microbatches to be a multiple of parallel.pp "
            f"(got {m} and {pp}); set schedule.n_microbatches={-(-m // pp) * pp}")

    def unit(k: int, r: int, backward: bool) -> tuple[int, int]:
        """(micro-batch, stage) of rank r's k-th forward or backward: a group of pp micro-batches runs
        through chunk 0, then chunk 1, ... (backwards: last chunk first) before the next group starts."""
        group, i = divmod(k, pp * vpp)
        chunk = vpp - 1 - i // pp if backward else i // pp
        return group * pp + i % pp, chunk * pp + r

    schedule = []
    for r in range(pp):
        forwards = [Action(F, *unit(k, r, False)) for k in range(m * vpp)]
        backwards = [Action(B, *unit(k, r, True)) for k in range(m * vpp)]
        # Warm up through every chunk but the last for one whole group, plus two per hop to the last rank
        # (Megatron's count; one would do at zero comm cost, the second hides a transfer's latency).
        schedule.append(_one_f_one_b(forwards, backwards, (vpp - 1) * pp + 2 * (pp - r - 1)))
    return schedule


def zb_h1(pp: int, n_microbatches: int, vpp: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into I and W, and rank r's W's deferred by r steps."""
    _one_chunk("zb-h1", vpp)
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
    if vpp != 2:
        raise ValueError(f"schedule 'zbv' holds exactly two chunks per rank; set parallel.vpp=2 (got {vpp})")
    m = n_microbatches
    n = max(m, 2 * pp - 1)  # plan a full pipeline, then drop the micro-batches that do not exist
    schedule = []
    for r in range(pp):
        down, up = r, 2 * pp - 1 - r  # chunk 0 on the way down the V, chunk 1 on the way back up
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
        while count[F, up] < n:  # steady state: F, I, W of each chunk in turn
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


def _one_chunk(name: str, vpp: int) -> None:
    if vpp != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank; set parallel.vpp=1 (got {vpp})")


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered schedule: its generator, how its stages are placed on ranks, whether it needs vpp>1."""

    generate: Callable[[int, int, int], Schedule]
    placement: str = "loop"
    needs_vpp: bool = False


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe),
    "1f1b": ScheduleSpec(one_f_one_b),
    "interleaved-1f1b": ScheduleSpec(interleaved_1f1b, needs_vpp=True),
    "zb-h1": ScheduleSpec(zb_h1),
    "zbv": ScheduleSpec(zbv, placement="v", needs_vpp=True),
}


def load_schedule(spec: "PipelineSpec") -> tuple[Schedule, str]:
    """Compute lists and placement of a pipeline spec: a registered schedule, or a table file."""
    if spec.schedule == "table":
        from .tables import load_table  # tables builds on this module

        if not spec.table_path or spec.table_path == "???":
            raise ValueError("schedule=table needs schedule.path=<a .csv or .json schedule table>")
        compute, meta = load_table(spec.table_path, pp=spec.pp, n_microbatches=spec.n_microbatches, vpp=spec.vpp)
        return compute, meta.placement
    if spec.schedule not in SCHEDULES:
        raise ValueError(f"schedule.name={spec.schedule} is not a known schedule; use one of "
                         f"{', '.join(sorted(SCHEDULES))}, or table with schedule.path=<file>")
    registered = SCHEDULES[spec.schedule]
    return registered.generate(spec.pp, spec.n_microbatches, spec.vpp), registered.placement


# --- Who talks to whom. ---------------------------------------------------------------------------------


def hand_over(action: Action, n_stages: int) -> tuple[Action, Action] | None:
    """The (SEND, RECV) pair carrying a compute action's output to the neighbouring stage, if it has one."""
    mb, s = action.microbatch, action.stage
    if action.kind is F and s < n_stages - 1:
        return Action(Kind.SEND_F, mb, s), Action(Kind.RECV_F, mb, s + 1)
    if action.kind in (B, I) and s > 0:  # I produces the input gradient just as B does
        return Action(Kind.SEND_B, mb, s), Action(Kind.RECV_B, mb, s - 1)
    return None


def needs(action: Action, n_stages: int) -> Action | None:
    """The RECV that names a compute action's input from a neighbouring stage (local or not), if any."""
    mb, s = action.microbatch, action.stage
    if action.kind is F and s > 0:
        return Action(Kind.RECV_F, mb, s)
    if action.kind in (B, I) and s < n_stages - 1:
        return Action(Kind.RECV_B, mb, s)
    return None


def counterpart(action: Action) -> Action:
    """The comm action on the other end: SEND_F(m, s) <-> RECV_F(m, s+1), SEND_B(m, s) <-> RECV_B(m, s-1)."""
    mb, s = action.microbatch, action.stage
    mates = {
        Kind.SEND_F: (Kind.RECV_F, s + 1),
        Kind.RECV_F: (Kind.SEND_F, s - 1),
        Kind.SEND_B: (Kind.RECV_B, s - 1),
        Kind.RECV_B: (Kind.SEND_B, s + 1),
    }
    if action.kind not in mates:
        raise ValueError(f"{action} is a compute action; only SEND_*/RECV_* have a counterpart")
    kind, stage = mates[action.kind]
    return Action(kind, mb, stage)


def comm_peer(action: Action, n_stages: int, placement: str, pp: int) -> int:
    """The pipeline rank a SEND_*/RECV_* action talks to."""
    stage = counterpart(action).stage
    if not 0 <= stage < n_stages:
        raise ValueError(f"{action} talks to stage {stage}, which does not exist ({n_stages} stages)")
    return stage_to_rank(stage, pp, placement)


# --- Lowering. ------------------------------------------------------------------------------------------


def lower(compute: Schedule, pp: int, n_stages: int, placement: str, costs: Costs | None = None) -> Schedule:
    """Add SEND_*/RECV_* to per-rank compute lists; neighbouring stages on one rank hand over locally.

    Order: run the compute lists on a timeline (`costs`, default F=1 B=2 I=1 W=1) where every action starts
    as soon as its rank is free and its input exists. A cross-rank hand-over gets the time t its producer
    ends, and both its SEND and its RECV go, on their own rank, right after the last compute that started
    before t. So the SEND directly follows its producer, the RECV precedes its consumer, and whatever comes
    before an op on its rank depends only on hand-overs with a smaller t: by induction on t, both ends of
    every pair get posted while the other waits, and no feasible schedule can deadlock.
    In 1F1B this yields the classic pairing: `F(i) SEND_F(i) RECV_B(j) B(j) SEND_B(j) RECV_F(i+1)`.
    Compute lists that cannot run to the end (a broken schedule) get RECV-just-before / SEND-just-after
    for the part that never ran, so `simulate.verify` can name the fault instead of this function.
    """
    costs = costs or Costs()
    if min(costs.f, costs.b, costs.i, costs.w) <= 0:
        raise ValueError("lowering needs positive compute costs (the placement argument relies on it)")
    owner = [stage_to_rank(s, pp, placement) for s in range(n_stages)]
    starts, ends = _timeline(compute, n_stages, owner, costs)

    gaps: list[dict[int, list]] = [{} for _ in range(pp)]  # rank -> gap index (before compute k) -> ops

    def put(rank: int, gap: int, key: tuple, action: Action) -> None:
        gaps[rank].setdefault(gap, []).append((key, action))

    for r, actions in enumerate(compute):
        for k, a in enumerate(actions):
            pair = hand_over(a, n_stages)
            if pair is None or owner[pair[1].stage] == r:
                continue  # nothing leaves the rank
            send, recv = pair
            q = owner[recv.stage]
            if k < len(ends[r]):  # the producer ran on the timeline
                t = ends[r][k]
                # Ties in t: sends before receives in a batch, then a fixed order on both ends of a channel.
                put(r, bisect_left(starts[r], t), (t, 0, send.stage, send.microbatch), send)
                put(q, bisect_left(starts[q], t), (t, 1, send.stage, send.microbatch), recv)
            else:  # never ran: keep it local to the producer and the consumer, and let verify explain
                put(r, k + 1, (float("inf"), 0, 0, 0), send)
                put(q, _first_consumer(compute[q], recv, n_stages), (float("inf"), 1, 0, 0), recv)

    lowered: Schedule = []
    for r, actions in enumerate(compute):
        out: list[Action] = []
        for k in range(len(actions) + 1):
            out += [a for _, a in sorted(gaps[r].get(k, []), key=lambda e: e[0])]
            if k < len(actions):
                out.append(actions[k])
        lowered.append(out)
    return lowered


def _timeline(
    compute: Schedule, n_stages: int, owner: list[int], costs: Costs
) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end times of each rank's runnable prefix: list order per rank, inputs before use."""
    arrived: dict[Action, float] = {}  # keyed by the RECV that names the input; when it is there
    starts: list[list[float]] = [[] for _ in compute]
    ends: list[list[float]] = [[] for _ in compute]
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(compute):
            while len(starts[r]) < len(actions):
                a = actions[len(starts[r])]
                need = needs(a, n_stages)
                if need is not None and need not in arrived:
                    break  # its input is not there yet; another rank must move first
                t0 = max(ends[r][-1] if ends[r] else 0.0, arrived.get(need, 0.0))
                t1 = t0 + costs.of(a.kind)
                starts[r].append(t0)
                ends[r].append(t1)
                pair = hand_over(a, n_stages)
                if pair is not None:
                    remote = owner[pair[1].stage] != r
                    arrived.setdefault(pair[1], t1 + (costs.comm if remote else 0.0))
                progress = True
    return starts, ends


def _first_consumer(actions: list[Action], recv: Action, n_stages: int) -> int:
    """Index of the first compute on a rank that needs `recv`'s data (end of list when none does)."""
    return next((k for k, a in enumerate(actions) if needs(a, n_stages) == recv), len(actions))
