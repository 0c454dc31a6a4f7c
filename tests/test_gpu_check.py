"""scripts/gpu_check.sh: ready for a CUDA machine, a clean skip elsewhere."""

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the script runs for real")
def test_gpu_check_skips_without_cuda(tmp_path):
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                              "PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "gpu_check: no CUDA device on this machine; skipped"
    assert not (tmp_path / "out").exists()
