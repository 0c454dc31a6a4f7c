"""Soak the readers' fuzz targets (tests/fuzz_targets.py) for longer than the suite's fixed budget.

Usage:
  python scripts/fuzz.py --minutes 30 [--target meta.json ...]

Each target is fed fresh random examples in rounds until its share of the time is spent; every example must be
accepted or refused in one line. Prints the examples run per target; the first failing example (shrunk by hypothesis)
ends the soak with its traceback and exit 1.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from tests.fuzz_targets import TARGETS, Target, in_fresh_folder  # noqa: E402

ROUND = 200  # examples per hypothesis run: a fresh random seed each round


def soak(target: Target, seconds: float) -> int:
    """Run `target` for about `seconds`; the number of examples run."""
    count = 0

    @settings(max_examples=ROUND, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def property_(data):
        nonlocal count
        count += 1
        in_fresh_folder(target, data)

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        property_()
    return count


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="total time, shared by the targets")
    parser.add_argument("--target", nargs="+", choices=[t.name for t in TARGETS], help="only these targets")
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # its warnings on odd rope fields would bury the counts
    if not args.minutes > 0:
        parser.error(f"--minutes={args.minutes} must be > 0")
    chosen = [t for t in TARGETS if args.target is None or t.name in args.target]
    share = args.minutes * 60 / len(chosen)
    total = 0
    for target in chosen:
        count = soak(target, share)
        total += count
        print(f"{target.name}: {count} examples, none failed", flush=True)
    print(f"fuzz: {total} examples in {args.minutes:g} min, none failed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
