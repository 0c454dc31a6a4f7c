"""No traceback reaches the user (issue 46, acceptance 3): the output of every train.py, export_hf.py and
generate.py process a test starts through `subprocess.run` is checked for a Python traceback (tests/conftest.py
wraps `subprocess.run` for every test). A launcher's own report (torchrun's ChildFailedError) is its own, not ours."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

SCRIPTS = ("train.py", "export_hf.py", "generate.py")
TRACEBACK = "Traceback (most recent call last)"


def user_facing(command: Any) -> bool:
    """True for a command that runs one of Sluice's entry points directly (python SCRIPT ...), not under torchrun."""
    if isinstance(command, (str, bytes, os.PathLike)) or not isinstance(command, Sequence) or not command:
        return False
    words = [str(word) for word in command]
    if os.path.basename(words[0]).startswith("torchrun") or "torch.distributed.run" in words:
        return False
    return any(os.path.basename(word) in SCRIPTS for word in words[:3])


def traceback_in(*streams: Any) -> str | None:
    """The traceback's text (from its first line) in any of `streams` (str or bytes), or None."""
    for stream in streams:
        text = stream.decode("utf-8", errors="replace") if isinstance(stream, bytes) else (stream or "")
        if TRACEBACK in text:
            return text[text.index(TRACEBACK):][:3000]
    return None
