"""Reliability: everything that keeps a run from hanging silently or dying unexplained.

hang.py       the hang watch: where each rank waits (action, peer, tag), dumped when a wait times out
heartbeat.py  ranks publish their progress to the launch store; a silent rank is named (and a stopped one ended)
watchdog.py   the thread that enforces `parallel.timeout_s` and reports a hang naming the culprit
guard.py      the step guard the loop calls at fixed points: fault injection, non-finite vote, skip policy
faults.py     `debug.fault` (stall, crash, nan) parsed and injected for rehearsals and tests
nonfinite.py  `train.on_nonfinite`: the all-rank vote on a non-finite loss or norm, stop or skip
failures.py   per-rank failure records and the launcher's choice of the first failure to report
flight_recorder.py  NCCL's flight recorder on, its dumps in the run directory (hang/) when a rank hangs
"""
