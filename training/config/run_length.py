"""How long a run is: `train.steps`, or `train.epochs` passes over the training samples (MiniMind counts epochs).

The samples are known once the data is read (packing decides how many a file gives), so the steps of an epoch run are
derived where the data is built; the command line may set one of the two, not both."""

import math
from typing import Any

from omegaconf import OmegaConf, open_dict, read_write


def epoch_steps(epochs: float, samples: int, per_step: int) -> int:
    """The optimizer steps that read `epochs` passes over `samples` training samples at `per_step` a step (the last
    step may run into the next pass); at least one."""
    return max(1, math.ceil(round(epochs * samples / per_step, 9)))  # 0.1 x 30 is 3.0000000000000004, not 4 steps


def length_problem(overrides: list[str], cfg: Any) -> str | None:
    """One line when the command line sets `train.steps` while `train.epochs` is set too (by it or by a preset)."""
    keys = {o.lstrip("+~").partition("=")[0]: o for o in overrides}
    epochs = OmegaConf.select(cfg, "train.epochs")
    if "train.steps" not in keys or epochs is None:
        return None
    source = "" if "train.epochs" in keys else f" (set by {_preset(overrides)})"
    return (f"{keys['train.steps']} and train.epochs={epochs:g}{source} both set the run's length; keep one "
            "(train.epochs=null to count in steps)")


def _preset(overrides: list[str]) -> str:
    """The preset override that most likely set a key: the experiment, else the config's defaults."""
    experiments = [o for o in overrides if o.lstrip("+").startswith("experiment=")]
    return experiments[-1] if experiments else "a preset"


def resolve_epochs(cfg: Any, samples: int, per_step: int) -> int | None:
    """Set `train.steps` from `train.epochs` (when set) and the training samples; return the steps, or None."""
    epochs = OmegaConf.select(cfg, "train.epochs")
    if epochs is None:
        return None
    steps = epoch_steps(float(epochs), samples, per_step)
    with read_write(cfg), open_dict(cfg):
        cfg.train.steps = steps
    return steps
