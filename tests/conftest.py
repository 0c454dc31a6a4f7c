"""Shared fixtures: golden reference files and tiny configs."""

import os
from pathlib import Path

# One intra-op thread per process. The suite runs two pytest workers on a few cores, and most tests start more
# processes; torch's default of one thread per core only oversubscribes them (tiny matmuls spend a second thread
# on synchronisation): measured on 2 cores, the whole suite 487 s -> 405 s. Set before torch is imported, so that
# every process a test starts inherits it; `OMP_NUM_THREADS=N pytest` overrides.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite is CPU tests: on a GPU host `parallel.backend=auto` would put every run a test starts on NCCL and CUDA
# (other numbers, other errors, GPUs shared by two pytest workers). SLUICE_TEST_GPU=1 keeps the GPUs visible.
if os.environ.get("SLUICE_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also when a plugin imported torch first

ROOT = Path(__file__).resolve().parent.parent  # pytest.ini puts it on sys.path (pythonpath = .)
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def load_golden(kind: str) -> dict:
    """A golden reference file (dense or moe) shipped with the tests."""
    return torch.load(FIXTURES / f"minimind3_tiny_{kind}.pt", weights_only=True)


@pytest.fixture(scope="session")
def golden_dense() -> dict:
    return load_golden("dense")


@pytest.fixture(scope="session")
def golden_moe() -> dict:
    return load_golden("moe")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One `data.cache_dir` for the train.py runs of this pytest worker: the embedded corpus's tokenizer is trained
    and its tokens cached once, not once per test (the cache's file locks make sharing it safe)."""
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(autouse=True)
def no_traceback_reaches_the_user(monkeypatch):
    """Every train.py / export_hf.py / generate.py process a test starts (subprocess.run, or Popen whose output the
    test reads through a pipe) shows no Python traceback in that output (tests/user_output.py): an error is one line,
    whatever the test asserts."""
    import subprocess

    from tests.user_output import traceback_in, user_facing, watched_popen

    original = subprocess.run

    def run(*args, **kwargs):
        result = original(*args, **kwargs)
        command = args[0] if args else kwargs.get("args")
        if user_facing(command) and (found := traceback_in(result.stdout, result.stderr)):
            pytest.fail(f"a traceback reached the user of {' '.join(map(str, command))[:300]}:\n{found}")
        return result

    monkeypatch.setattr(subprocess, "run", run)
    started: list = []  # the user-facing processes the test started with Popen
    monkeypatch.setattr(subprocess, "Popen", watched_popen(subprocess.Popen, started))
    yield
    for proc in started:
        if found := proc.traceback():
            pytest.fail(f"a traceback reached the user of {' '.join(map(str, proc.args))[:300]}:\n{found}")


def pytest_sessionfinish(session, exitstatus):
    """The session's pooled worker processes leave with it (tests/spawn.py)."""
    from tests.spawn import close_pools

    close_pools()


def pytest_collection_modifyitems(config, items):
    """Mark every test of a module that starts processes (`run_workers`, `subprocess`) as `multiprocess`, so that
    `pytest -m multiprocess` runs exactly those (the load and flakiness checks)."""
    starts: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in starts:
            text = Path(path).read_text()
            starts[path] = "run_workers(" in text or "subprocess." in text
        if starts[path]:
            item.add_marker(pytest.mark.multiprocess)
