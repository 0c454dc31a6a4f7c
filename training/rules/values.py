"""Value rules: the range or choice a schema key's value must satisfy, as small named functions.

Types come from the schema (OmegaConf refuses `train.steps=many` while composing); a rule adds what a type cannot
say, and each schema key names its rule beside its default (`training.config.schema`). Rules that relate several
keys live in `training.config.validate`.
"""

import math
import os
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from training.reliability.faults import parse_fault

Rule = Callable[[str, Any], "str | None"]  # (key, value) -> the one-line problem, or None when fine


class ConfigError(ValueError):
    """A bad run config; the message is one line naming the key and the fix."""


def shown(value: Any) -> str:
    """A value as the user typed it (lists without OmegaConf's wrapper)."""
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value)
    return str(value)


def positive(key: str, value: Any) -> str | None:
    if not math.isfinite(value):
        return f"{key}={value} must be a finite number > 0"
    if value <= 0:
        return f"{key}={value} must be positive; set {key} to a value > 0"
    return None


def non_negative(key: str, value: Any) -> str | None:
    if not math.isfinite(value) or value < 0:
        return f"{key}={value} must be a finite number >= 0 (0 turns it off)"
    return None


def at_least(low: int) -> Rule:
    def check(key: str, value: Any) -> str | None:
        return f"{key}={value} must be >= {low}" if value < low else None
    return check


def seed_value(key: str, value: Any) -> str | None:
    """A seed: 0 to 2**32 - 1 (what every generator takes; seed * 1_000_003 + a name's crc32 stays in 64 bits)."""
    if value < 0:
        return f"{key}={value} must be >= 0"
    return None if value < 2**32 else f"{key}={value} must be between 0 and {2**32 - 1} (a 32-bit seed)"


def fraction(closed_top: bool = False) -> Rule:
    """A number in [0, 1) (or [0, 1] with closed_top)."""
    top = "1]" if closed_top else "1)"

    def check(key: str, value: Any) -> str | None:
        inside = 0.0 <= value <= 1.0 if closed_top else 0.0 <= value < 1.0
        return None if inside else f"{key}={value} must lie in [0, {top}"
    return check


def one_of(*choices: Any) -> Rule:
    def check(key: str, value: Any) -> str | None:
        if value in choices:
            return None
        named = (str(c).lower() if isinstance(c, bool) else str(c) for c in choices)  # as written: true, not True
        return f"{key}={value} is not supported; use one of {', '.join(named)}"
    return check


def optional(inner: Rule) -> Rule:
    """null is allowed (it means "off" or "derive it"); any other value must pass `inner`."""
    return lambda key, value: None if value is None else inner(key, value)


def text(key: str, value: Any) -> str | None:
    return f"{key} is empty; give it a value" if not str(value).strip() else None


def any_of_type(key: str, value: Any) -> str | None:
    """The schema's type is the whole rule (booleans)."""
    return None


def existing_path(key: str, value: Any) -> str | None:
    if value is not None and not os.path.exists(value):
        return f"{key}={value} does not exist; give an existing path or drop the override"
    return None


def betas(key: str, value: Any) -> str | None:
    if len(value) != 2 or not all(0.0 <= b < 1.0 for b in value):
        return f"{key}={shown(value)} must be two numbers in [0, 1)"
    return None


def backends(key: str, value: Any) -> str | None:
    names = list(value)
    for name in names:
        if name not in LOGGER_BACKENDS:
            return f"{key}={shown(value)}: unknown logger {name!r}; use any of {', '.join(LOGGER_BACKENDS)}"
    if len(set(names)) != len(names) or ("none" in names and len(names) > 1):
        return f"{key}={shown(value)} repeats a logger or mixes none with loggers; list each logger once"
    return None


def fault(key: str, value: Any) -> str | None:
    try:
        parse_fault(value)
    except ValueError as error:
        return f"{key}={value}: {error}"
    return None


def layer_counts(key: str, value: Any) -> str | None:
    """null, auto or a list; the counts themselves are checked by parallel.pipeline.partition.layer_partition."""
    if value is None or value == "auto" or isinstance(value, (list, ListConfig)):
        return None
    return f"{key}={value}: give one layer count per stage (e.g. [3,3,2]), auto, or null for the even split"


def schedule_name(key: str, value: Any) -> str | None:
    from parallel.pipeline.schedules import SCHEDULES  # the registry is the closed set

    return one_of(*sorted(SCHEDULES), "module", "table")(key, value)


LOGGER_BACKENDS = ("tensorboard", "wandb", "none")
