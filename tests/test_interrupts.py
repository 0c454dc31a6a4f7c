"""SIGINT and SIGTERM finish the step in flight, save, exit 130/143 with the resume command; a resumed run equals an
uninterrupted one bit for bit, and its metrics.jsonl holds each step once; resume=auto with nothing to resume from
is refused before launch."""

import json
import re
import subprocess
import sys
from multiprocessing.pool import ThreadPool
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from parallel.grid import ParallelGrid
from tests.conftest import ROOT
from tests.test_config_errors import launch_here
from tests.equivalence import layouts_worker
from tests.spawn import run_workers
from training.config.schema import compose_config
from training.report.console import run_dir_problem
from training.report.metrics import drop_rows_after
from training.trainer import Trainer

TINY = ["model=tiny", "train.seq_len=32", "train.micro_batch_size=2", "schedule.n_microbatches=2",
        "data.num_docs=300", "logger=none", "train.dtype=fp32", "train.log_every=1", "optim.warmup_steps=1"]
STEPS = 5


def train(args: list[str], cache: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """A run of train.py (one process, or self-launched workers) that must end by itself."""
    cmd = [sys.executable, "train.py", *TINY, f"train.steps={STEPS}", *args, f"data.cache_dir={cache}",
           f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def sluice_lines(stderr: str) -> list[str]:
    """The `sluice:` lines as a terminal shows them (a progress bar's carriage returns start a line over)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    return [s.strip() for line in stderr.split("\n") for s in line.split("\r") if s.strip().startswith("sluice:")]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every row of metrics.jsonl, in file order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows]


def final_tensors(run_dir: Path, tmp: Path) -> dict:
    """Every tensor of the run's step-STEPS checkpoint (weights, optimizer state), read back from DCP."""
    flat = tmp / f"{run_dir.name}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step_{STEPS:08d}"), str(flat))
    state = torch.load(flat, weights_only=False)
    out = {}

    def walk(node, name):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{name}/{key}")
        elif isinstance(node, torch.Tensor):
            out[name] = node

    walk(state, "")
    return out


def assert_resumed_equals(resumed: Path, baseline: Path, tmp: Path) -> None:
    """The same losses at every step, each step once, and bit-for-bit equal final weights and optimizer state."""
    assert losses(resumed) == losses(baseline)
    assert [step for step, _ in losses(resumed)] == list(range(1, STEPS + 1))
    ours, theirs = final_tensors(resumed, tmp), final_tensors(baseline, tmp)
    assert ours.keys() == theirs.keys() and len(ours) > 10
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]


def resume_line(line: str, signal: str, step: int, run_dir: Path) -> None:
    """The one line an interrupted run ends with: the signal, the step, the checkpoint and the command."""
    saved = run_dir / "checkpoints" / f"step_{step:08d}"
    prefix = f"sluice: interrupted by {signal} at step {step}: saved checkpoint step {step} to {saved}; resume with: "
    assert line.startswith(prefix), line
    command = line.removeprefix(prefix)
    assert command.startswith(f"{sys.executable} train.py ") and command.endswith(
        f" hydra.run.dir={run_dir} checkpoint.resume=auto"), command
    assert (saved / "COMPLETE").is_file()


# dp2 with one micro-batch per replica: the baseline's global batch (two micro-batches accumulated), so the one-process
# run is the reference (fp32: equal to rounding; the one-process SIGTERM test is bit for bit).
DP2 = ["parallel.dp=2", "schedule.n_microbatches=1", "parallel.timeout_s=60"]


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory, data_cache) -> dict[str, tuple[subprocess.CompletedProcess | None, Path]]:
    """The module's first runs, side by side (independent runs: only their start-ups overlap): the uninterrupted
    baseline (in this process), and train.py with SIGTERM at step 3 of a fresh resume=auto run, SIGINT at step 2
    with checkpointing off, and SIGTERM to rank 1 alone of two self-launched dp2 ranks at step 2."""
    base = tmp_path_factory.mktemp("interrupts")
    plans = {"sigterm": ["debug.fault='sigterm@rank=0,step=3'", "checkpoint.resume=auto"],
             "sigint": ["debug.fault='sigint@rank=0,step=2'", "checkpoint.save_final=false"],
             "one-of-two": [*DP2, "debug.fault='sigterm@rank=1,step=2'"]}  # rank 1 only: they agree
    with ThreadPool(len(plans)) as pool:
        results = pool.map_async(lambda name: train(plans[name], data_cache, base / name / "run"), plans)
        # The uninterrupted baseline meanwhile, in this process: what is tested is the interrupted runs' train.py,
        # not the reference's, and its own process would cost an interpreter start-up. train.py's one-process job
        # is this Trainer on the config its overrides compose (tests/test_quick_start.py).
        cfg = compose_config([*TINY, f"train.steps={STEPS}", f"data.cache_dir={data_cache}"])
        Trainer(cfg, ParallelGrid.single(torch.device("cpu")), base / "baseline" / "run").fit()
        results = results.get()
    return {"baseline": (None, base / "baseline" / "run"),
            **{name: (result, base / name / "run") for name, result in zip(plans, results)}}


@pytest.fixture(scope="module")
def baseline(first_runs) -> Path:
    """An uninterrupted one-process run of STEPS steps."""
    return first_runs["baseline"][1]


def test_sigterm_saves_the_step_and_resume_auto_equals_an_uninterrupted_run(tmp_path, data_cache, baseline,
                                                                            first_runs):
    """Also the user's path of a run started with checkpoint.resume=auto (once tests/test_checkpoint.py's
    test_train_py_saves_then_resumes_auto): a fresh directory starts fresh, the same command continues it."""
    result, run_dir = first_runs["sigterm"]
    saved = run_dir / "checkpoints" / "step_00000003"
    assert result.returncode == 143, result.stderr[-3000:]
    lines = sluice_lines(result.stderr)
    assert lines[0].startswith("sluice: SIGTERM: stopping after step 3"), lines
    resume_line(lines[-1], "SIGTERM", 3, run_dir)
    assert f"no complete checkpoint in {run_dir / 'checkpoints'}: starting fresh" in result.stdout
    assert f"saved checkpoint step 3 to {saved} in " in result.stdout
    assert "interrupted by SIGTERM at step 3 (of 5 steps): 3 steps in" in result.stdout
    assert [step for step, _ in losses(run_dir)] == [1, 2, 3]

    resumed = train(["checkpoint.resume=auto"], data_cache, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {saved} (step 3)" in resumed.stdout and "saved checkpoint step 5 to " in resumed.stdout
    assert "done: 2 steps from step 3 in" in resumed.stdout  # this run's steps, not the global step
    assert_resumed_equals(run_dir, baseline, tmp_path)


def test_sigint_with_checkpointing_off_says_nothing_was_saved_and_resume_auto_is_then_refused(first_runs, data_cache,
                                                                                               capsys):
    result, run_dir = first_runs["sigint"]
    assert result.returncode == 130, result.stderr[-3000:]
    assert sluice_lines(result.stderr)[-1] == (
        "sluice: interrupted by SIGINT at step 2: nothing was saved (checkpoint.every=0 and checkpoint.save_final="
        "false); set checkpoint.save_final=true or checkpoint.every=N to save when interrupted")
    assert not (run_dir / "checkpoints").exists()

    # train.py's path in this process (tests/test_config_errors.py): refused before any worker starts
    refused = launch_here([*TINY, f"train.steps={STEPS}", "checkpoint.resume=auto", f"data.cache_dir={data_cache}",
                           f"hydra.run.dir={run_dir}"], capsys)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert sluice_lines(refused.stderr) == [
        f"sluice: config error: checkpoint.resume=auto: run directory {run_dir} holds metrics.jsonl but "
        f"{run_dir / 'checkpoints'} holds no complete checkpoint to resume from; start a fresh run (a new "
        "hydra.run.dir, or drop it), or resume from an explicit checkpoint with checkpoint.resume=<checkpoint folder>"]
    assert [step for step, _ in losses(run_dir)] == [1, 2]  # untouched


def test_a_signal_to_one_of_two_self_launched_ranks_stops_both_after_the_same_step_and_resumes_equal(
        tmp_path, data_cache, baseline, first_runs):
    """The dp2 run of `first_runs` (the baseline's global batch: see DP2)."""
    result, run_dir = first_runs["one-of-two"]
    assert result.returncode == 143, result.stderr[-3000:]
    lines = sluice_lines(result.stderr)
    # Rank 0 got no signal itself: its notice comes from step 2's vote, exact (the root adds nothing).
    assert len(lines) == 2 and lines[0] == "sluice: SIGTERM: stopping after step 2; send it again to stop at once", \
        lines
    resume_line(lines[1], "SIGTERM", 2, run_dir)
    # The resume in the session's pooled workers (train.py's resume=auto: the one-process test above): both ranks
    # load the step both saved. The overrides are train.py's (its lr, its final save) on top of the helpers' base.
    resumed = [*TINY, f"train.steps={STEPS}", *DP2, "checkpoint.resume=auto", "optim.lr=5e-4",
               "checkpoint.save_final=true"]
    run_workers(layouts_worker, 2, [(resumed, str(run_dir))], str(data_cache), timeout=300)
    ours, theirs = losses(run_dir), losses(baseline)
    assert [step for step, _ in ours] == list(range(1, STEPS + 1))
    assert all(abs(a - b) <= 1e-5 * abs(b) for (_, a), (_, b) in zip(ours, theirs)), (ours, theirs)
    ours, theirs = final_tensors(run_dir, tmp_path), final_tensors(baseline, tmp_path)
    ours = {k: v for k, v in ours.items() if not k.startswith("/rng/")}  # every rank's own RNG stream
    assert ours.keys() == {k for k in theirs if not k.startswith("/rng/")} and len(ours) > 10
    far = [k for k in ours if (ours[k].double() - theirs[k].double()).norm() > 1e-4 * theirs[k].double().norm() + 1e-12]
    assert not far, far


def test_resume_auto_is_refused_only_where_metrics_have_no_checkpoint(tmp_path):
    assert run_dir_problem(tmp_path, "auto") is None  # a fresh directory: nothing to mix
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    problem = run_dir_problem(tmp_path, "auto")
    assert problem and problem.startswith("checkpoint.resume=auto: run directory") and "hydra.run.dir" in problem
    elsewhere = tmp_path / "elsewhere" / "step_00000001"
    elsewhere.mkdir(parents=True)
    (elsewhere / "COMPLETE").write_text("complete\n")
    (elsewhere / "meta.json").write_text("{}")
    assert run_dir_problem(tmp_path, "auto", elsewhere.parent) is None  # checkpoint.dir set: looked for there
    assert run_dir_problem(tmp_path, "auto") is not None


def test_resuming_drops_the_metrics_rows_after_the_checkpoint_atomically(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": step, "loss": 1.0 / step}) for step in range(1, 6)]
    metrics.write_text("\n".join(rows) + '\n{"step": 6, "lo')  # killed mid-write
    assert drop_rows_after(metrics, 3) == 3
    assert metrics.read_text().splitlines() == rows[:3]
    assert drop_rows_after(metrics, 3) == 0 and not list(tmp_path.glob(".*tmp"))
    assert re.fullmatch(r"(\{.*\}\n){3}", metrics.read_text())


WATCHDOG = """
import os, signal, sys, time
from pathlib import Path
from training.reliability.hang import Watch
from training.reliability.watchdog import Limits, start_watchdog

case, run_dir = sys.argv[1], Path(sys.argv[2])
watch = Watch(0)
watch.run_dir = run_dir
watch.step = 0 if case == "start-up" else 3
timeout_s = 0.5 if case == "deadline" else 60  # a step that never ends (a dead peer, a wedged call)
start_watchdog(watch, Limits(timeout_s, 60), announce=True, follow_launcher=case == "peer failed")  # launched


def wait_for(condition):  # a condition polled, bounded: the watchdog thread acts on its own
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            sys.exit("timed out")
        time.sleep(0.01)


if case == "peer failed":
    (run_dir / "failures").mkdir()
    (run_dir / "failures" / "rank1.json").write_text("{}")  # a peer's failure: the launcher is stopping this rank
os.kill(os.getpid(), signal.SIGTERM)
if case == "twice":
    wait_for(lambda: watch.interrupt is not None)
    os.kill(os.getpid(), signal.SIGTERM)  # at once: the same request delivered twice (Slurm and torchrun)
    wait_for(lambda: watch.interrupt.repeats == 1)  # taken as the same request (a loaded machine may be slow to)
    watch.interrupt.at -= 10  # as if the user sent it again later
    print("still running", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
wait_for(lambda: False)
"""


NOTICE = "sluice: SIGTERM: stopping after step 3, or step 4 if step 3 is already ending; send it again to stop at once"


@pytest.mark.parametrize("case, lines", [
    ("start-up", ["sluice: interrupted by SIGTERM in start-up"]),
    ("peer failed", []),
    ("twice", [NOTICE,
               "sluice: interrupted by SIGTERM again in step 3: stopped at once, nothing saved"]),
    ("deadline", [NOTICE,
                  "sluice: interrupted by SIGTERM: step 3 did not end within parallel.timeout_s=0.5; nothing was "
                  "saved"]),
])
def test_the_watchdog_ends_the_process_in_start_up_after_a_peer_failed_on_a_second_signal_or_past_the_timeout(
        tmp_path, case, lines):
    result = subprocess.run([sys.executable, "-c", WATCHDOG, case, str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 143, result.stderr[-3000:]
    assert sluice_lines(result.stderr) == lines
    assert ("still running" in result.stdout) == (case == "twice")  # the duplicate within REPEAT_S was ignored


def test_rank_0_announces_a_stop_once_whether_the_vote_or_its_own_signal_comes_first(capsys):
    """Ctrl-C reaches every process; on a loaded machine rank 0's watchdog may take its copy after a peer's copy
    came back in the step's vote (the two-worker Ctrl-C test once printed no notice at all). One notice either way."""
    import signal
    import time

    from omegaconf import OmegaConf

    from training.reliability.guard import StepGuard
    from training.reliability.hang import Watch
    from training.reliability.watchdog import _on_signal

    def guard_at_step_3() -> StepGuard:
        cfg = OmegaConf.create({"train": {"on_nonfinite": "stop", "max_skipped_steps": 1}, "debug": {"fault": None}})
        guard = StepGuard(cfg, ParallelGrid.single("cpu"), Watch(0, groups={"world": [0]}))
        guard.begin(3)
        return guard

    vote_first = guard_at_step_3()
    vote_first.faults.signalled = signal.SIGINT  # the vote carries a peer's SIGINT (one process: its flag)
    assert vote_first.should_step(3, 2.5, 1.0) and vote_first.stop_signal == signal.SIGINT
    _on_signal(vote_first.watch, signal.SIGINT, time.time(), alone=False)  # rank 0's own copy, late: the same stop
    assert vote_first.watch.interrupt.own and vote_first.watch.interrupt.repeats == 1
    own_first = guard_at_step_3()
    _on_signal(own_first.watch, signal.SIGINT, time.time(), alone=False)
    assert own_first.should_step(3, 2.5, 1.0) and own_first.stop_signal == signal.SIGINT
    assert capsys.readouterr().err.splitlines() == [
        "sluice: SIGINT: stopping after step 3; send it again to stop at once",
        "sluice: SIGINT: stopping after step 3, or step 4 if step 3 is already ending; send it again to stop at once"]
