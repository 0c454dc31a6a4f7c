"""Expensive fixture results computed once per test session, whichever pytest-xdist worker asks first.

pytest-xdist's work stealing splits a module's tests between workers wherever its queue happens to be cut, and each
worker then builds that module's fixtures again: a multi-process training spawn of tens of seconds, twice. Here
the first worker computes under a file lock in the session's shared temp folder and saves the result; any other
waits for the lock and loads it (pytest-xdist's documented recipe for a once-per-session fixture).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from filelock import FileLock

T = TypeVar("T")


def session_dir(factory: pytest.TempPathFactory, key: str) -> Path:
    """A folder named `key` that every worker of this test session sees (created once)."""
    base = factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / key
    folder.mkdir(exist_ok=True)
    return folder


def once_per_session(factory: pytest.TempPathFactory, key: str, compute: Callable[[Path], T]) -> T:
    """compute(root) in the shared folder `key`, once per session: the result is saved beside it and loaded by every
    later caller (a computation that raised is tried again by the next)."""
    root = session_dir(factory, key)
    result = root / "result.pt"
    with FileLock(str(root.parent / f".{key}.lock")):
        if result.exists():
            return torch.load(result, weights_only=False)  # our own file, written below
        value = compute(root)
        torch.save(value, result)
        return value
