"""No traceback reaches the user (issue 46, acceptance 3): the output of every train.py, export_hf.py and
generate.py process a test starts is checked for a Python traceback (tests/conftest.py wraps `subprocess.run` and
`subprocess.Popen` for every test: what `run` returns, and what a test reads of a Popen's pipes, by iteration, read,
readline or communicate). A launcher's own report (torchrun's ChildFailedError) is its own, not ours."""

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


class _Tee:
    """A process's pipe that keeps what the test reads of it."""

    def __init__(self, stream: Any, kept: list):
        self._stream, self._kept = stream, kept

    def __iter__(self):
        for line in self._stream:
            self._kept.append(line)
            yield line

    def read(self, *args):
        data = self._stream.read(*args)
        self._kept.append(data)
        return data

    def readline(self, *args):
        line = self._stream.readline(*args)
        self._kept.append(line)
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def watched_popen(popen: type, started: list) -> type:
    """subprocess.Popen for a test: a user-facing process's pipes keep what the test reads of them, and the process
    is recorded in `started` (its `traceback()` read after the test)."""

    class Watched(popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.kept: list = []
            if user_facing(self.args):
                started.append(self)
                for name in ("stdout", "stderr"):
                    if getattr(self, name) is not None:
                        setattr(self, name, _Tee(getattr(self, name), self.kept))

        def communicate(self, *args, **kwargs):
            streams = {name: getattr(self, name) for name in ("stdout", "stderr")}
            for name, stream in streams.items():  # communicate reads the raw pipes itself
                if isinstance(stream, _Tee):
                    setattr(self, name, stream._stream)
            try:
                out = super().communicate(*args, **kwargs)
            finally:
                for name, stream in streams.items():
                    setattr(self, name, stream)
            self.kept.extend(part for part in out if part)
            return out

        def traceback(self) -> str | None:
            return traceback_in(*self.kept)

    return Watched
