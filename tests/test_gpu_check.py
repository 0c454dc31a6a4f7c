"""scripts/gpu_check.py, the device acceptance check: every run composes and validates on the CPU (--dry-run), the
table and its ranges judge figures as written, a machine without CUDA skips cleanly; the runs themselves need a GPU."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                                            "CUDA_VISIBLE_DEVICES": "", **env})


def test_dry_run_composes_and_validates_every_run_and_prints_each_range(gpu_check):
    done = script("--dry-run")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    for run in gpu_check.RUNS:
        assert any(line.startswith(f"gpu_check: {run.name}: ") and "composes and validates" in line
                   for line in lines), run.name
    table = lines[-len(gpu_check.CHECKS):]
    assert [line.split("  ")[0] for line in table] == [c.name for c in gpu_check.CHECKS]
    row = {line.split("  ")[0]: line.split() for line in table}
    assert row["host syncs per step: dense"][-5:] == ["-", "0", "..", "2", "dry", "run"][-5:]
    assert row["1B Llama shape bf16: MFU"][-6:] == ["-", "0.25", "..", "0.8", "dry", "run"]
    assert row["2 GPUs tp2 vs GPU: loss"][-7:] == ["-", "0", "..", "0.0001", "rel", "dry", "run"]


def test_a_machine_without_cuda_skips_in_one_line(tmp_path):
    done = script("--out", str(tmp_path / "out"))
    assert (done.returncode, done.stdout.strip()) == (0, "gpu_check: no CUDA device on this machine; skipped "
                                                         "(--dry-run checks the commands anywhere)")
    assert not (tmp_path / "out").exists()


def test_a_word_that_names_no_check_is_refused(tmp_path):
    done = script("--only", "warp-drive")
    assert done.returncode == 2
    assert done.stderr.strip() == "gpu_check: no check's name holds warp-drive; see --dry-run for the list"


def rows(loss_gap: float = 0.0, mfu: float = 0.3) -> dict:
    base = [{"step": s, "loss": 5.0 - s / 10, "grad_norm": 2.0} for s in range(1, 6)]
    return {"gpu": base, "cpu": [{**r, "loss": r["loss"] * (1 + loss_gap)} for r in base],
            "saved": base, "resumed": base[3:], "syncs_dense": [{"per_step": {"3": 2, "4": 5}}],
            "minimind3_eager": [{"step": 30, "tokens_per_s": 4e5, "mfu": mfu}]}


def test_the_table_judges_each_figure_against_its_range_and_says_why_one_is_missing(gpu_check):
    checks = [c for c in gpu_check.CHECKS if c.name.startswith(("fp32", "save", "host syncs per step: dense",
                                                                "MiniMind-3 64M bf16 eager", "2 GPUs tp2"))]
    notes = {"gpu2_tp2": "skipped (needs 2 GPUs, 1 here)"}
    verdicts = gpu_check.judge(checks, rows(loss_gap=3e-5), notes)
    assert [v.ok for v in verdicts] == [True, True, True, False, True, True, None, None]
    table = gpu_check.table(verdicts)
    assert table[1].split() == ["fp32", "GPU", "vs", "CPU:", "loss", "3e-05", "0", "..", "0.0001", "rel", "ok"]
    assert table[4].split()[-7:] == ["5", "0", "..", "2", "OUT", "OF", "RANGE"]  # 5 syncs in step 4
    assert table[-1].endswith("skipped (needs 2 GPUs, 1 here)")
    worse = gpu_check.judge(checks, rows(loss_gap=2e-4, mfu=0.05), notes)
    assert [v.ok for v in worse][:2] == [False, True] and worse[5].ok is False
    no_mfu = {**rows(), "minimind3_eager": [{"step": 30, "tokens_per_s": 4e5}]}  # an unknown GPU's peak
    assert gpu_check.judge(checks, no_mfu, notes)[5].ok is False


def test_the_exit_status_is_one_when_a_figure_is_out_of_range(gpu_check, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    measured = rows()
    monkeypatch.setattr(gpu_check, "execute", lambda runs, out, gpus: (measured, {}))
    assert gpu_check.main(["--out", str(tmp_path), "--only", "GPU vs CPU", "save at"]) == 0
    assert (tmp_path / "table.txt").read_text().count(" ok\n") == 3
    measured = rows(loss_gap=1e-3)
    assert gpu_check.main(["--out", str(tmp_path), "--only", "GPU vs CPU"]) == 1
    assert "OUT OF RANGE" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (SLUICE_TEST_GPU=1 on a GPU host)")
def test_on_a_gpu_fp32_equals_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--only", "fp32 GPU vs CPU"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
