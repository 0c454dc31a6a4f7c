#!/usr/bin/env bash
# The device acceptance check (scripts/gpu_check.py): on a CUDA machine it runs every check (under 10 minutes on one
# GPU, more checks with two) and prints one table with each expected range; exit 1 when a figure is outside it.
#   bash scripts/gpu_check.sh                # outputs under gpu_check_out/
#   bash scripts/gpu_check.sh --dry-run      # anywhere: every run composes and validates, the checks and ranges
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" scripts/gpu_check.py "$@"
