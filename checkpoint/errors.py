"""The error of the checkpoint layer, in a file of its own so that every checkpoint module can raise it without
importing another's (confine.py checks the files dense.py reads)."""


class CheckpointError(ValueError):
    """A checkpoint or dense weights that cannot be read or do not match the model; one readable message."""
