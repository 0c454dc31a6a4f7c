"""The gradient sync of a sharded step (`parallel.zero=2/3`): FSDP's end of each stage's step, beside the buckets.

`GradientSync` still carries the step's loss sums and reduces the parameters FSDP keeps whole (`parallel.fsdp`);
here each stage's FSDP gradients are finished right after that stage's final backward (its last B, or last W under
I/W): reduce-scattered there if they waited unsharded through the micro-batches (zero=2, or an I/W stage), as
torch's pipelining does with `set_requires_gradient_sync`, else the per-micro-batch reductions awaited. Every DP rank
of a stage runs the same actions, so the collectives match by order.
"""

from __future__ import annotations

from parallel.fsdp import ShardedStage, begin_step, reduce_stage
from parallel.grad_sync import GradientSync
from parallel.pipeline.actions import Action


class ShardedSync(GradientSync):
    """A `GradientSync` that also reduces each stage's FSDP gradients after its final backward."""

    def __init__(self, *args, roots: dict[int, ShardedStage], **kwargs):
        super().__init__(*args, **kwargs)
        self.roots = roots  # stage -> its FSDP root

    def start_step(self) -> None:
        begin_step(self.roots)
        super().start_step()

    def after(self, action: Action) -> None:
        if self.final_actions.get(action.stage) == action and action.stage in self.roots:
            reduce_stage(self.roots[action.stage].root)
        super().after(action)
