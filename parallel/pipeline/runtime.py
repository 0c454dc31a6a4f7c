"""The runtime: one loop that executes any rank's lowered action list with its Stages and a Transport.

It holds no schedule-specific branch: warm-up, steady state and cool-down exist only in the list.

Communication. A run of consecutive SEND_*/RECV_* actions is posted as one batch, in list order, and the loop
moves on at once: a receive is waited for only right before the compute that consumes it, a send only at
the end of the step, or earlier once it is proven done. Its tensor is dropped once the transport reports the
transfer done: under NCCL as soon as it is; gloo reports a send done only when waited for, so a rank about to
wait anyway first waits for the sends that an arrival has proven done (release.py), which return at once.
So a RECV that the lowering placed ahead of its consumer overlaps the computes in between, and every send
overlaps what follows it.

Why this stays deadlock-free wherever the lowering's model (wait for a whole batch before posting the next)
is: (1) every op is posted at its own place in the list, so each peer pair sees the same posting order, and
FIFO matching and NCCL's one stream per pair see the same sequence as before; (2) a rank blocks only on a
receive right before its consumer and on its sends at the end, each at or after the point where the batch
model blocked on the same op (a send waited for mid-step is one already proven done: it does not block).
An op completes once both ends are posted (under NCCL also once the ops before it on the pair's stream did,
an order the batch model already obeyed). Posts can only move earlier and waits only later, so by induction
over the order in which the batch model completes ops, every op completes here.

Receiving early. Where the transport says posted receives never hold up other transfers (gloo: each op
progresses on its own; not NCCL, whose ops on a peer pair share one stream in posting order), every RECV is
posted one compute earlier than the list places it, in the same order among the receives. A receive then
meets its send while the previous compute runs, instead of starting the transfer's round trip (gloo's
"ready to receive" notice, then the data) only when its consumer is next. The argument above still holds:
posts only move earlier, the order of the receives from each peer is kept, waits stay where they were.
It costs at most one boundary buffer per rank held one compute longer. And a rank that must wait for an input
posts, before it blocks, the receives of the run that follows that compute: they cost nothing while it waits,
and the gap between that compute and the next, on the critical path when this rank is the slow one, then
carries only sends. (Posts move earlier again; the order of each peer's receives is unchanged.)

`make_program` cuts a list into these runs once per engine. `run` is a generator that yields whenever the list must
wait for a transfer: `execute` waits on the transport (one process per rank); `execute_emulated` switches to
another rank (all ranks in one process).
"""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from parallel.step import MicroBatch

from .actions import Action, Kind
from .stage import Stage
from .transport import SENDS, EmulationError, LocalTransport, Message, Pending, Transport

ACTIVATION, GRADIENT = "activation", "gradient"
Timed = tuple[Action, float, float]  # (action, start, end) in time.perf_counter seconds


class ComputeHooks(Protocol):
    """Called around every compute action (the engine uses it to start gradient reductions early)."""

    def before(self, action: Action) -> None: ...

    def after(self, action: Action) -> None: ...


@dataclass
class StepScales:
    """Per-step constants every stage needs: the global loss and aux-loss scales, and the compute hooks."""

    loss_scale: torch.Tensor | float  # 1 / label tokens in the global batch (a host float, or a device tensor)
    aux_scale: float  # 1 / micro-batches in the global batch
    hooks: ComputeHooks | None = None


@dataclass
class Blocked:
    """What `run` yields: the rank cannot pass `slot` (`action`) until `pending` is ready."""

    slot: int
    action: Action
    pending: Pending


def comm_runs(actions: list[Action]) -> list[tuple[int, list[Action]]]:
    """Split a list into (first slot, run): each compute action alone, consecutive comm actions together."""
    runs: list[tuple[int, list[Action]]] = []
    for slot, action in enumerate(actions):
        if action.kind.is_comm and runs and runs[-1][1][0].kind.is_comm:
            runs[-1][1].append(action)
        else:
            runs.append((slot, [action]))
    return runs


def early_receive_runs(actions: list[Action]) -> list[tuple[int, list[Action]]]:
    """`comm_runs`, with each run's receives posted before the compute that precedes the run (see above)."""
    runs: list[tuple[int, list[Action]]] = []
    last_compute: int | None = None  # index in `runs` of the latest compute
    for slot, group in comm_runs(actions):
        if not group[0].kind.is_comm:
            last_compute = len(runs)
            runs.append((slot, group))
            continue
        receives = [a for a in group if a.kind not in SENDS]
        if last_compute is not None and receives:
            before = runs[last_compute - 1] if last_compute > 0 else None
            if before is not None and before[1][0].kind.is_comm:
                before[1].extend(receives)  # after that run's own ops: the receives keep their order
            else:
                runs.insert(last_compute, (runs[last_compute][0], receives))
                last_compute += 1
            group = [a for a in group if a.kind in SENDS]
        if group:
            runs.append((slot, group))
    return runs


class Transfer(NamedTuple):
    """One SEND/RECV as the loop posts it: the action, its peer rank, its mailbox key, whether it sends."""

    action: Action
    peer: int
    key: tuple[str, int, int]
    sends: bool


class Run(NamedTuple):
    """One place in the loop: a compute (with its input's mailbox key), or a batch of transfers posted together."""

    slot: int  # index in the lowered list of the run's first action
    compute: Action | None
    input_key: tuple[str, int, int] | None  # where a compute finds its input from another stage (None: no input)
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True)
class Program:
    """One rank's lowered list as the loop executes it, made once per engine rather than every step: code
    between a compute's end and its send's post runs cold on a rank that slept in a wait, so it is kept short."""

    runs: tuple[Run, ...]
    n_actions: int
    receives_early: bool  # the transport lets receives be posted ahead of the list (see the module docstring)
    releases: dict[Action, tuple[Action, ...]]  # RECV -> the sends its arrival proves done (see release.py)


def make_program(actions: list[Action], peer_of: Callable[[Action], int], receives_early: bool,
                 releases: dict[Action, tuple[Action, ...]]) -> Program:
    """Cut the list into runs (receives moved early when the transport allows it) and resolve every peer."""
    runs = []
    for slot, group in early_receive_runs(actions) if receives_early else comm_runs(actions):
        head = group[0]
        if head.kind.is_comm:
            transfers = tuple(Transfer(a, peer_of(a), _key(a), a.kind in SENDS) for a in group)
            runs.append(Run(slot, None, None, transfers))
        else:
            runs.append(Run(slot, head, _input_key(head), ()))
    return Program(tuple(runs), len(actions), receives_early, releases)


def run(program: Program, stages: dict[int, Stage], transport: Transport, micro_batches: list[MicroBatch],
        scales: StepScales, timings: list[Timed] | None = None) -> Iterator[Blocked]:
    """Execute one rank's program; gradients accumulate in the stages' parameters. Yields where it must wait."""
    mail = _Mail(program, transport)
    hooks = scales.hooks
    finished: Action | None = None  # the last compute; its `after` hook waits until its outputs are sent
    for index, step in enumerate(program.runs):
        start = time.perf_counter() if timings is not None else 0.0
        action = step.compute
        if action is None:
            mail.post(index, step)
            if timings is not None:
                timings.extend((t.action, start, time.perf_counter()) for t in step.transfers)
        if finished is not None and hooks is not None:
            # After the sends: a hook's work (launching reductions) must not delay the next stage's input.
            hooks.after(finished)
        finished = None
        if action is None:
            continue
        received = yield from mail.take_input(index, step)
        mail.drop_sent()
        if timings is not None:
            start = time.perf_counter()
        if hooks is not None:
            hooks.before(action)
        _compute(action, stages, received, micro_batches, scales, mail.inbox, mail.outbox)
        del received  # a received boundary tensor is the stage's leaf now, or no one's
        if timings is not None:
            timings.append((action, start, time.perf_counter()))
        finished = action
    if finished is not None and hooks is not None:
        hooks.after(finished)
    yield from mail.finish()


@dataclass
class _Mail:
    """One step's boundary tensors on this rank: what arrived, what waits for its SEND, what is on the wire."""

    program: Program
    transport: Transport
    inbox: dict[tuple[str, int, int], torch.Tensor | Pending] = field(default_factory=dict)  # by receiver
    outbox: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # by sender
    sending: dict[Action, Pending] = field(default_factory=dict)  # posted sends, oldest first, holding their tensor
    done: list[Action] = field(default_factory=list)  # sends an arrival proved done (release.py), not yet waited
    ahead: int = -1  # index of the run whose receives were posted while the rank waited

    def post(self, index: int, step: Run) -> None:
        """Post one run of transfers (less the receives posted ahead) as one batch."""
        transfers = step.transfers if index != self.ahead else tuple(t for t in step.transfers if t.sends)
        _post(transfers, self.transport, self.inbox, self.outbox, self.sending)

    def take_input(self, index: int, step: Run) -> Iterator[Blocked]:
        """A compute's input from another stage (None if it has none), waiting for it if it is not there yet.

        A rank that must wait posts the next run's receives first and waits for the sends proven done: both
        cost nothing while it waits, and the next gap then carries only sends."""
        received = self.inbox.pop(step.input_key, None) if step.input_key is not None else None
        if received is None or isinstance(received, torch.Tensor):
            return received
        if not received.ready():
            runs = self.program.runs
            if self.program.receives_early and index + 1 < len(runs):
                receives = tuple(t for t in runs[index + 1].transfers if not t.sends)
                if receives:
                    _post(receives, self.transport, self.inbox, {}, {})
                    self.ahead = index + 1
            self.release_done()
            yield Blocked(step.slot, step.compute, received)  # resumed once it is ready
        self.done.extend(self.program.releases.get(received.message.action, ()))
        return received.tensor

    def release_done(self) -> None:
        """Wait for the sends proven done (it returns at once) so their tensors go now, not at the step's end."""
        for action in self.done:
            pending = self.sending.pop(action, None)
            if pending is not None:
                pending.wait()
        self.done.clear()

    def drop_sent(self) -> None:
        """Drop the sends the transport reports done, oldest first (O(1) where none reports early: gloo)."""
        while self.sending:
            oldest = next(iter(self.sending))
            if not self.sending[oldest].ready():
                return
            del self.sending[oldest]

    def finish(self) -> Iterator[Blocked]:
        """Wait for every send still on the wire; nothing may be left unconsumed."""
        for pending in self.sending.values():
            if not pending.ready():
                yield Blocked(self.program.n_actions, pending.message.action, pending)
        if self.inbox or self.outbox:
            left = sorted(self.inbox) + sorted(self.outbox)
            raise RuntimeError(f"unconsumed boundary tensors (a broken schedule): {left}")


def _post(transfers: tuple[Transfer, ...], transport: Transport, inbox: dict, outbox: dict,
          sending: dict[Action, Pending]) -> None:
    """Post one run of transfers as one batch: sends take their tensor from the outbox, receives file a
    Pending in the inbox. A function of its own, so no local outlives the post and pins a sent tensor."""
    messages = [Message(t.action, t.peer, outbox.pop(t.key) if t.sends else None) for t in transfers]
    for pending, transfer in zip(transport.post(messages), transfers):
        if transfer.sends:
            sending[transfer.action] = pending
        else:
            inbox[transfer.key] = pending


def _key(comm: Action) -> tuple[str, int, int]:
    """Mailbox key of a SEND's tensor (by sending stage) or a RECV's (by receiving stage)."""
    # A sampled token (SEND_T/RECV_T) is a forward's output and the next forward's input, keyed as activations are.
    what = GRADIENT if comm.kind in (Kind.SEND_B, Kind.RECV_B) else ACTIVATION
    return what, comm.microbatch, comm.stage


def _input_key(action: Action) -> tuple[str, int, int] | None:
    """The mailbox key of a compute's input from a neighbouring stage (never there for the first F or last B)."""
    if action.kind is Kind.W:
        return None  # W works on what its I left behind
    return ACTIVATION if action.kind is Kind.F else GRADIENT, action.microbatch, action.stage


def _compute(action: Action, stages: dict[int, Stage], inputs: torch.Tensor | None, micro_batches: list[MicroBatch],
             scales: StepScales, inbox: dict, outbox: dict) -> None:
    """One F, B, I or W of one micro-batch on one local stage; its output goes to a local stage or a SEND."""
    mb, s = action.microbatch, action.stage
    stage = stages[s]
    batch = micro_batches[mb]
    if action.kind is Kind.F:
        # A first stage takes the micro-batch's token ids, unless a token was sent to it (a generation tick's).
        if stage.is_first and inputs is None:
            inputs = batch.input_ids.to(stage.device, non_blocking=True)
        labels = batch.labels.to(stage.device, non_blocking=True) if stage.is_last and batch.labels is not None else None
        out, what, to = (stage.forward(mb, inputs, labels, scales.loss_scale, scales.aux_scale, batch.extra),
                         ACTIVATION, s + 1)
    elif action.kind in (Kind.B, Kind.I):
        backward = stage.backward if action.kind is Kind.B else stage.backward_input
        out, what, to = backward(mb, inputs), GRADIENT, s - 1
    elif action.kind is Kind.W:
        stage.backward_weight(mb)
        return
    else:
        raise ValueError(f"{action}: not a compute action")
    if out is not None:
        # A neighbouring stage on this rank takes it directly; otherwise it waits for its SEND.
        (inbox if to in stages else outbox)[(what, mb, to if to in stages else s)] = out


def execute(program: Program, stages: dict[int, Stage], transport: Transport, micro_batches: list[MicroBatch],
            scales: StepScales, timings: list[Timed] | None = None) -> None:
    """Run this rank's step, waiting on the transport (with its timeout) wherever the list must wait."""
    for blocked in run(program, stages, transport, micro_batches, scales, timings):
        blocked.pending.wait()


def execute_emulated(programs: dict[int, Program], stages: dict[int, dict[int, Stage]], hub: LocalTransport,
                     micro_batches: list[MicroBatch], scales: StepScales,
                     timings: dict[int, list[Timed]] | None = None) -> None:
    """Run every pipeline rank's step in this process: each rank runs until it blocks on a receive, then the next.

    The same lists and the same loop as `execute`; only waiting differs. The switching order is fixed, so
    TP peers emulating the same ranks issue their collectives in the same order. Deadlock (no rank can move)
    raises EmulationError naming every blocked rank, its slot and the transfer it waits for.
    """
    runs = {r: run(program, stages[r], hub.endpoint(r), micro_batches, scales,
                   None if timings is None else timings.setdefault(r, [])) for r, program in programs.items()}
    blocked: dict[int, Blocked | None] = dict.fromkeys(runs)
    while runs:
        progressed = False
        for r in list(runs):
            if blocked[r] is not None and not blocked[r].pending.ready():
                continue
            progressed = True
            try:
                blocked[r] = next(runs[r])
            except StopIteration:
                del runs[r]
        if not progressed:
            waits = [f"rank {r}, slot {b.slot}, {b.action} waits for {b.pending.message.action} from rank "
                     f"{b.pending.message.peer}" for r, b in blocked.items() if r in runs]
            raise EmulationError("deadlock: " + "; ".join(waits))
    if hub.unconsumed():
        raise EmulationError(f"messages never received: {hub.unconsumed()}")
