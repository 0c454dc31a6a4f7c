"""Sluice training: config, launch, trainer, data, optimizer and metrics."""
