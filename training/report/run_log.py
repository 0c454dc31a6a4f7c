"""train.log, written as every run file is: appended without following a link (checkpoint.atomic_write).

Hydra's own job logging opens `<run dir>/train.log` with `logging.FileHandler`, which appends through a link planted
in a reused run directory (hydra.run.dir) to whatever file it names. Before anything is logged, the Hydra task swaps
that handler for this one on the same file (`confine_log_files`); the self-launched workers' logging
(training.launch.workers) uses it from the start."""

import logging
import sys

from checkpoint.atomic_write import open_append
from checkpoint.errors import CheckpointError


class ConfinedFileHandler(logging.FileHandler):
    """A FileHandler whose file is opened by `open_append`: a link or a FIFO there ends the run before launch."""

    def _open(self):
        try:
            return open_append(self.baseFilename, "the run's log")
        except CheckpointError as error:
            # Raised inside logging's configuration (Hydra's), an exception would be reported as a traceback of
            # logging internals: this is bad input before launch, said in one line.
            print(f"sluice: {error}", file=sys.stderr)
            raise SystemExit(2) from None


def confine_log_files() -> None:
    """Replace the root logger's plain FileHandlers (Hydra's train.log) with ConfinedFileHandlers on the same files,
    before any line is written through them; a link or FIFO there ends the run in one line (exit 2)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) is logging.FileHandler:
            root.removeHandler(handler)
            handler.close()
            confined = ConfinedFileHandler(handler.baseFilename, mode=handler.mode, encoding=handler.encoding)
            confined.setFormatter(handler.formatter)
            confined.setLevel(handler.level)
            root.addHandler(confined)
