"""Reliability: everything that keeps a run from hanging silently or dying unexplained (hang watch, heartbeats,
watchdog, step guard, fault injection, non-finite vote, failure records, NCCL's flight recorder)."""
