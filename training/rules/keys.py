"""How a schema key is declared: its default, value rule, meaning and scope in one dataclass field."""

from dataclasses import dataclass, field
from typing import Any

from training.rules.values import Rule, any_of_type


@dataclass(frozen=True)
class ReadWhen:
    """A key read only under another key's value: elsewhere it is refused (`refuse`) or ignored with a warning."""

    switch: str
    values: tuple[Any, ...]
    refuse: bool


def key(default: Any, meaning: str, rule: Rule = any_of_type, read_when: ReadWhen | None = None) -> Any:
    """A schema field: its default, its value rule and its one-line meaning (markdown), kept together."""
    metadata = {"meaning": meaning, "rule": rule, "read_when": read_when}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)
