"""The conftest check that no traceback reaches the user (tests/user_output.py) sees what it must."""

import subprocess
import sys

from tests.conftest import ROOT
from tests.user_output import traceback_in, user_facing


def test_entry_points_are_checked_and_launchers_are_not():
    assert user_facing([sys.executable, "train.py", "model=tiny"])
    assert user_facing([sys.executable, str(ROOT / "scripts" / "export_hf.py"), "a", "b"])
    assert not user_facing(["torchrun", "--standalone", "train.py"])
    assert not user_facing([sys.executable, "-c", "pass"]) and not user_facing("train.py")


def test_a_traceback_is_found_in_either_stream():
    assert traceback_in("", b"x\nTraceback (most recent call last):\n  File ...").startswith("Traceback")
    assert traceback_in("sluice: one line", None) is None


def test_an_entry_point_refusing_bad_input_prints_no_traceback():
    """export_hf.py with a source that does not exist: one line (and the conftest wrapper checked it too)."""
    done = subprocess.run([sys.executable, "scripts/export_hf.py", "/nonexistent-source", "/nonexistent-out"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and traceback_in(done.stdout, done.stderr) is None
