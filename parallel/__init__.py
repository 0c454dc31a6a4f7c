"""Parallelism passes over a single-device MiniMind: the rank grid, tensor and pipeline parallelism."""
