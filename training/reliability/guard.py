"""StepGuard: the trainer loop's reliability hooks in one object (fault injection, hang watch, non-finite policy)."""

import math

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from parallel.grid import ParallelGrid
from training.reliability.hang import Watch
from training.reliability.faults import FaultInjector
from training.reliability.nonfinite import SkipPolicy, step_vote
from training.reliability.watchdog import Interrupt, announce_agreed_stop, claim_stop


class StepGuard:
    """Called by the loop at fixed points of every step; `watch` tells the hang doctor where this rank is."""

    def __init__(self, cfg: DictConfig, grid: ParallelGrid, watch: Watch | None = None,
                 faults: FaultInjector | None = None):
        self.grid = grid
        self.watch = watch if watch is not None else Watch(grid.rank)  # nobody reads it without a watchdog
        self.faults = faults if faults is not None else FaultInjector(OmegaConf.select(cfg, "debug.fault"), grid.rank)
        self.policy = SkipPolicy(cfg.train.on_nonfinite, cfg.train.max_skipped_steps)
        self.world = dist.group.WORLD if grid.world_size > 1 else None
        self.stop_signal = 0  # SIGINT/SIGTERM every rank agreed on in the last vote: save after this step and stop
        self.grad_norm = math.nan  # the last vote's grad norm, read back from the device

    @property
    def skipped(self) -> int:
        """Optimizer updates skipped so far (train.on_nonfinite=skip)."""
        return self.policy.skipped

    def begin(self, step: int) -> None:
        """Start of 1-based `step`: an injected crash or stall; the engine's waits are recorded as they come."""
        self.watch.step = step
        self.watch.enter(f"step {step}: starting")  # no collective here: the data carries the token count
        self.watch.publish()  # said before any fault: a rank that stops or dies in this step is described by it
        self.faults.begin_step(step)

    def after_engine(self, step: int, loss: float, params: list[torch.nn.Parameter]) -> float:
        """The step's gradients are summed: an injected NaN; the grad-norm collective comes next."""
        loss = self.faults.poison(step, loss, params)
        self.watch.collective(f"step {step}: grad-norm all-reduce", "mp")
        return loss

    def should_step(self, step: int, loss: float, grad_norm: float | torch.Tensor) -> bool:
        """One verdict on every rank: update, skip (False) or stop (NonFiniteError); and whether to stop after it.
        The vote reads the device's grad norm back: `grad_norm` holds it as a host float afterwards."""
        self.watch.collective(f"step {step}: non-finite check", "world")
        signo = max(self.watch.interrupt.signo if self.watch.interrupt else 0, self.faults.signalled)
        what, self.stop_signal, self.grad_norm = step_vote(loss, grad_norm, signo, self.world, self.grid.device)
        if self.stop_signal and claim_stop(self.watch, Interrupt(self.stop_signal, own=False)):
            announce_agreed_stop(self.watch, self.stop_signal, step)  # a peer got it: this rank's copy may still come
        verdict = self.policy.should_step(step, what, loss, self.grad_norm)
        self.watch.collective(f"step {step}: optimizer step", "dp")  # ZeRO-1 broadcasts its shards
        return verdict

    def checkpointing(self, step: int) -> None:
        """After `step`'s update: a checkpoint save when one is due. Local work with no peer to wait for, so not timed:
        a save longer than parallel.timeout_s is slow storage, not a hang (a peer that dies meanwhile is named by the
        heartbeats)."""
        self.watch.enter(f"after step {step}: saving a checkpoint if one is due")

    def saving_on_interrupt(self) -> None:
        """The stop agreed on is being saved: the watchdog's bound on the step in flight no longer applies."""
        if self.watch.interrupt is not None:
            self.watch.interrupt.saving = True

    def evaluating(self, step: int) -> None:
        """Validation after `step`: forward-only pipeline waits and loss sums over the whole grid."""
        self.watch.collective(f"step {step}: validation", "world")

    def comparing_compiled(self, step: int) -> None:
        """train.compile=auto's trial: its last step's all-reduce of the timings waits for every rank."""
        self.watch.collective(f"step {step}: train.compile=auto's timing all-reduce", "world")

    def logging(self, step: int) -> None:
        """A logged step's record: its peak-memory gather (and expert load) wait for every rank. Said, so that a peer
        stopped between the step's vote and this gather is timed like any wait, not taken for local work."""
        self.watch.collective(f"step {step}: logging's peak-memory gather", "world")

    def end(self, step: int) -> None:
        """The step is done: local work (logging, data) until the next one."""
        self.watch.done(f"step {step}")
        self.watch.enter(f"after step {step} (logging, data)")
