"""The runtime: one loop that executes any rank's lowered action list with its Stages and a Transport.

It holds no schedule-specific branch: warm-up, steady state and cool-down exist only in the list.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from training.data import MicroBatch

from .actions import Action, Kind
from .stage import Stage
from .transport import Message, Transport

ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass
class StepPlan:
    """Per-step constants every stage needs: the global loss and aux-loss scales."""

    loss_scale: float  # 1 / label tokens in the global batch
    aux_scale: float  # 1 / micro-batches in the global batch


@dataclass
class Mailboxes:
    """Tensors waiting to be consumed (inbox) or sent (outbox), keyed by (what, micro-batch, stage)."""

    inbox: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    outbox: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)


def comm_runs(actions: list[Action]) -> list[list[Action]]:
    """Split a list into runs: each compute action alone, consecutive comm actions together (one batch)."""
    runs: list[list[Action]] = []
    for action in actions:
        if action.kind.is_comm and runs and runs[-1][0].kind.is_comm:
            runs[-1].append(action)
        else:
            runs.append([action])
    return runs


def execute(actions: list[Action], stages: dict[int, Stage], transport: Transport,
            peer_of: Callable[[Action], int], micro_batches: list[MicroBatch], plan: StepPlan) -> None:
    """Run one step's actions on this rank; gradients accumulate in the stages' parameters."""
    box = Mailboxes()
    for run in comm_runs(actions):
        if run[0].kind.is_comm:
            _communicate(run, transport, peer_of, box)
        else:
            _compute(run[0], stages, micro_batches, plan, box)
    assert not box.inbox and not box.outbox, f"unconsumed boundary tensors: {sorted(box.inbox) + sorted(box.outbox)}"


def _communicate(run: list[Action], transport: Transport, peer_of: Callable[[Action], int], box: Mailboxes) -> None:
    """Post one batch of sends and receives; file received tensors in the inbox under the receiving stage."""
    messages = []
    for action in run:
        mb, s = action.microbatch, action.stage
        if action.kind is Kind.SEND_F:
            messages.append(Message(action, peer_of(action), box.outbox.pop((ACTIVATION, mb, s))))
        elif action.kind is Kind.SEND_B:
            messages.append(Message(action, peer_of(action), box.outbox.pop((GRADIENT, mb, s))))
        else:
            messages.append(Message(action, peer_of(action)))
    for action, tensor in transport.exchange(messages).items():
        what = ACTIVATION if action.kind is Kind.RECV_F else GRADIENT
        box.inbox[(what, action.microbatch, action.stage)] = tensor


def _deliver(box: Mailboxes, stages: dict[int, Stage], what: str, mb: int, to_stage: int, from_stage: int,
             tensor: torch.Tensor) -> None:
    """Hand a boundary tensor to a local stage directly, or leave it in the outbox for a SEND."""
    if to_stage in stages:
        box.inbox[(what, mb, to_stage)] = tensor
    else:
        box.outbox[(what, mb, from_stage)] = tensor


def _compute(action: Action, stages: dict[int, Stage], micro_batches: list[MicroBatch], plan: StepPlan,
             box: Mailboxes) -> None:
    """One F or B of one micro-batch on one local stage."""
    mb, s = action.microbatch, action.stage
    stage = stages[s]
    batch = micro_batches[mb]
    if action.kind is Kind.F:
        inputs = batch.input_ids.to(stage.device) if stage.is_first else box.inbox.pop((ACTIVATION, mb, s))
        labels = batch.labels.to(stage.device) if stage.is_last else None
        out = stage.forward(mb, inputs, labels, plan.loss_scale, plan.aux_scale)
        if out is not None:
            _deliver(box, stages, ACTIVATION, mb, s + 1, s, out)
    elif action.kind is Kind.B:
        grad = None if stage.is_last else box.inbox.pop((GRADIENT, mb, s))
        grad_input = stage.backward(mb, grad)
        if grad_input is not None:
            _deliver(box, stages, GRADIENT, mb, s - 1, s, grad_input)
    else:
        raise NotImplementedError(f"{action}: the runtime has no {action.kind.value} yet")
