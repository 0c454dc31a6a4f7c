"""Reporting a run: metrics per step, the console line, the loggers (JSONL, TensorBoard, W&B), the run header, FLOPs
and train.log."""
