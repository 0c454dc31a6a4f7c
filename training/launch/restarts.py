"""train.max_restarts: a self-launched group that loses a worker starts again from its newest complete checkpoint.

Exact resume makes a restart invisible in the numbers: the resumed run recomputes the steps after the checkpoint
bit for bit. What a restart cannot fix is a fault that comes back every time (a bad sample, a broken node); so
restarts are counted per checkpoint they resume from, and a run that fails more than max_restarts times after
the same checkpoint ends with the cause. Progress (a newer checkpoint) starts a fresh count, as a long run
that loses a node a day must keep going. torchrun users get the same with `--max-restarts` and
`checkpoint.resume=auto` (docs/launching.md).
"""

from dataclasses import dataclass, field
from pathlib import Path

from checkpoint.manager import complete_checkpoints


@dataclass
class RestartBudget:
    """Restarts allowed per checkpoint resumed from (0: never restart)."""

    limit: int
    counts: dict[int, int] = field(default_factory=dict)

    def allow(self, from_step: int) -> bool:
        """Count one more failure after the checkpoint of `from_step`; True when a restart is still allowed."""
        self.counts[from_step] = self.counts.get(from_step, 0) + 1
        return self.counts[from_step] <= self.limit

    def used(self, from_step: int) -> int:
        return self.counts.get(from_step, 0)


def newest_step(checkpoint_dir: Path) -> int:
    """The step of the newest complete checkpoint in `checkpoint_dir` (0: none, the run restarts from scratch)."""
    found = complete_checkpoints(Path(checkpoint_dir))
    return int(found[-1].name.split("_")[-1]) if found else 0


def restart_resume(original: str | None, checkpoint_dir: Path) -> str | None:
    """checkpoint.resume for a restarted group: its own newest checkpoint, else what the run first resumed from."""
    return "auto" if complete_checkpoints(Path(checkpoint_dir)) else original
