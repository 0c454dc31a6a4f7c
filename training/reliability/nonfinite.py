"""Non-finite loss or grad norm: one decision taken by every rank together (`train.on_nonfinite=stop|skip`).

`skip` drops that step's optimizer update on every rank (gradients zeroed, AdamW state untouched) while the
step still counts: its data is consumed and the learning-rate schedule moves on, exactly as if the update
had been computed and thrown away. So a skipped step k leaves the parameters equal to a run whose optimizer
simply did not step at k. More than `train.max_skipped_steps` skips in a row stop the run.
"""

import math

import torch
import torch.distributed as dist

from parallel.collectives import all_reduce_

class NonFiniteError(RuntimeError):
    """The loss or grad norm of a step is NaN/Inf and the run must stop; the message names the step."""


def step_vote(loss: float, grad_norm: float | torch.Tensor, signo: int, group,
              device: torch.device) -> tuple[str | None, int, float]:
    """The non-finite verdict, the stop signal (0: none; the highest any rank of `group` received) and the grad norm
    as a host float, agreed by one small all-reduce (a signal reaches ranks at different moments, or only some of
    them) and read in the step's one host read after the engine's: the norm's finiteness is judged on the device."""
    norm = torch.as_tensor(grad_norm, dtype=torch.float64, device=device)
    bad = torch.stack([torch.full((), not math.isfinite(loss), dtype=torch.int32, device=device),
                       norm.isfinite().logical_not().int(), torch.full((), signo, dtype=torch.int32, device=device)])
    flags = all_reduce_(bad, group, dist.ReduceOp.MAX)  # element-wise MAX of 0/1 = OR over ranks
    *flags, signal, norm_value = torch.cat([flags.double(), norm.view(1)]).tolist()
    what = " and ".join(name for name, flag in zip(("loss", "grad norm"), flags) if flag) or None
    return what, int(signal), norm_value


class SkipPolicy:
    """Applies `train.on_nonfinite` to one step's verdict; counts the skips."""

    def __init__(self, mode: str, max_in_a_row: int):
        if mode not in ("stop", "skip"):
            raise ValueError(f"train.on_nonfinite={mode} is not supported; use stop or skip")
        self.mode, self.max_in_a_row = mode, max_in_a_row
        self.skipped = 0  # in the whole run
        self.in_a_row = 0

    def should_step(self, step: int, what: str | None, loss: float, grad_norm: float) -> bool:
        """True: apply the update. False: skip it. Raises NonFiniteError when the run must stop."""
        if what is None:
            self.in_a_row = 0
            return True
        seen = f"non-finite {what} at step {step} (loss={loss}, grad_norm={grad_norm})"
        if self.mode == "stop":
            raise NonFiniteError(f"{seen}; stopped (train.on_nonfinite=stop). Lower optim.lr, check the data "
                                 "and the loaded weights, or set train.on_nonfinite=skip")
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row > self.max_in_a_row:
            raise NonFiniteError(f"{seen}: {self.in_a_row} steps in a row were non-finite, more than "
                                 f"train.max_skipped_steps={self.max_in_a_row}; stopped")
        return False
