"""Launching a run: the command line, the self-launched workers, rendezvous, restarts, the cluster and output paths,
and the checks that must pass before any worker starts (memory fit, the layout's world size)."""
