"""Parallelism passes over a single-device decoder: the rank grid, tensor and pipeline parallelism.

The package names no model: it finds a model's pieces through the plans the model declares (`parallel.decoder`).
"""
