"""Sluice entry point: `python train.py [overrides]` or `torchrun ... train.py [overrides]`."""

from training.cli import main

if __name__ == "__main__":
    main()
