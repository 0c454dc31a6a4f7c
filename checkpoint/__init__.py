"""Dense weights in and out, and sharded training checkpoints."""
