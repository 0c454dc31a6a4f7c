"""Property-based fuzzing of every reader a crafted folder reaches, and of train.py's values (tests/fuzz_targets.py):
each mutated input is accepted or refused in one line, never a traceback. A fixed budget here (each target's
`examples`, derandomized so the suite is repeatable); `scripts/fuzz.py --minutes N` soaks them for longer."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.fuzz_targets import TARGETS, in_fresh_folder


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_a_mutated_file_is_accepted_or_one_line(target):
    @settings(max_examples=target.examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def property_(data):
        in_fresh_folder(target, data)

    property_()
