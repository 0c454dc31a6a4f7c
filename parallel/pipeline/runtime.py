"""The runtime: one loop that executes any rank's lowered action list with its Stages and a Transport.

It holds no schedule-specific branch: warm-up, steady state and cool-down exist only in the list.

Communication. A run of consecutive SEND_*/RECV_* actions is posted as one batch, in list order, and the loop
moves on at once: a receive is waited for only right before the compute that consumes it, a send only
before the step ends (its tensor is dropped as soon as the transfer is done). So a RECV that the lowering
placed ahead of its consumer overlaps the computes in between, and every send overlaps what follows it.
Why this cannot deadlock where the lowering's batch model (wait for the whole batch at once) does not:
every op is posted at the same place in the same list, so each peer pair posts in the same relative
order as before (FIFO matching and NCCL's per-pair stream order are untouched); and a rank now blocks
only on a subset of what it blocked on before, later or at the same point. Completion of an op depends
only on both ends having been posted, which can only happen earlier now, so by induction over the batch
model's completion order every op still completes.

`run` is a generator that yields whenever the list must wait for a transfer: `execute` waits on the
transport (one process per rank); `execute_emulated` switches to another rank (all ranks in one process).
"""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from training.data import MicroBatch

from .actions import Action, Kind
from .stage import Stage
from .transport import SENDS, EmulationError, LocalTransport, Message, Pending, Transport

ACTIVATION, GRADIENT = "activation", "gradient"
Record = tuple[str, float, float]  # (action, start, end) in time.perf_counter seconds


@dataclass
class StepPlan:
    """Per-step constants every stage needs: the global loss and aux-loss scales."""

    loss_scale: float  # 1 / label tokens in the global batch
    aux_scale: float  # 1 / micro-batches in the global batch


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


def run(actions: list[Action], stages: dict[int, Stage], transport: Transport, peer_of: Callable[[Action], int],
        micro_batches: list[MicroBatch], plan: StepPlan, records: list[Record] | None = None) -> Iterator[Blocked]:
    """Execute one rank's list; gradients accumulate in the stages' parameters. Yields where it must wait."""
    inbox: dict[tuple[str, int, int], torch.Tensor | Pending] = {}  # inputs of local computes, by receiver
    outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # outputs waiting for their SEND, by sender
    sending: list[Pending] = []
    for slot, group in comm_runs(actions):
        start = time.perf_counter()
        if group[0].kind.is_comm:
            messages = [Message(a, peer_of(a), outbox.pop(_key(a)) if a.kind in SENDS else None) for a in group]
            for pending in transport.post(messages):
                if pending.message.action.kind in SENDS:
                    sending.append(pending)
                else:
                    inbox[_key(pending.message.action)] = pending
            _record(records, group, start)
            continue
        action = group[0]
        key = _input_key(action)
        inputs = inbox.pop(key, None) if key else None
        if inputs is not None and not isinstance(inputs, torch.Tensor):  # a receive still in flight
            if not inputs.ready():
                yield Blocked(slot, action, inputs)
            inputs = inputs.tensor
        sending = [p for p in sending if not p.ready()]  # release what the wire is done with
        start = time.perf_counter()
        _compute(action, stages, inputs, micro_batches, plan, inbox, outbox)
        _record(records, group, start)
    for pending in sending:
        if not pending.ready():
            yield Blocked(len(actions), pending.message.action, pending)
    assert not inbox and not outbox, f"unconsumed boundary tensors: {sorted(inbox) + sorted(outbox)}"


def _record(records: list[Record] | None, group: list[Action], start: float) -> None:
    if records is not None:
        end = time.perf_counter()
        records.extend((str(a), start, end) for a in group)


def _key(comm: Action) -> tuple[str, int, int]:
    """Mailbox key of a SEND's tensor (by sending stage) or a RECV's (by receiving stage)."""
    what = ACTIVATION if comm.kind in (Kind.SEND_F, Kind.RECV_F) else GRADIENT
    return what, comm.microbatch, comm.stage


def _input_key(action: Action) -> tuple[str, int, int] | None:
    """The mailbox key of a compute's input from a neighbouring stage, if it has one."""
    if action.kind is Kind.F:
        return ACTIVATION, action.microbatch, action.stage
    if action.kind in (Kind.B, Kind.I):
        return GRADIENT, action.microbatch, action.stage
    return None


def _compute(action: Action, stages: dict[int, Stage], inputs: torch.Tensor | None, micro_batches: list[MicroBatch],
             plan: StepPlan, inbox: dict, outbox: dict) -> None:
    """One F, B, I or W of one micro-batch on one local stage; its output goes to a local stage or a SEND."""
    mb, s = action.microbatch, action.stage
    stage = stages[s]
    batch = micro_batches[mb]
    if action.kind is Kind.F:
        inputs = batch.input_ids.to(stage.device) if stage.is_first else inputs
        labels = batch.labels.to(stage.device) if stage.is_last else None
        out, what, to = stage.forward(mb, inputs, labels, plan.loss_scale, plan.aux_scale), ACTIVATION, s + 1
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


def execute(actions: list[Action], stages: dict[int, Stage], transport: Transport, peer_of: Callable[[Action], int],
            micro_batches: list[MicroBatch], plan: StepPlan, records: list[Record] | None = None) -> None:
    """Run this rank's step, waiting on the transport (with its timeout) wherever the list must wait."""
    for blocked in run(actions, stages, transport, peer_of, micro_batches, plan, records):
        blocked.pending.wait()


def execute_emulated(lists: dict[int, list[Action]], stages: dict[int, dict[int, Stage]], hub: LocalTransport,
                     peer_of: Callable[[Action], int], micro_batches: list[MicroBatch], plan: StepPlan,
                     records: dict[int, list[Record]] | None = None) -> None:
    """Run every pipeline rank's step in this process: each rank runs until it blocks on a receive, then the next.

    The same lists and the same loop as `execute`; only waiting differs. The switching order is fixed, so
    TP peers emulating the same ranks issue their collectives in the same order. Deadlock (no rank can move)
    raises EmulationError naming every blocked rank, its slot and the transfer it waits for.
    """
    runs = {r: run(actions, stages[r], hub.endpoint(r), peer_of, micro_batches, plan,
                   None if records is None else records.setdefault(r, [])) for r, actions in lists.items()}
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
    assert not hub.unconsumed(), f"messages never received: {hub.unconsumed()}"
