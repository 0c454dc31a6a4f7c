"""Sluice entry point: `python train.py [overrides]` or `torchrun ... train.py [overrides]`."""

import gc

from training.launch.cli import main

if __name__ == "__main__":
    # torch's and Hydra's import-time objects live as long as the process: the collector skips them from here on
    # (each full collection, and the last one at exit, walked them all: about 1 CPU second a process).
    gc.freeze()
    main()
