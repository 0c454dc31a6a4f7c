"""A schedule registered anywhere in SCHEDULES leaves the schedule tests green (issue 47, acceptance 3).

The registry's order is what tests and tools walk (mutants, lowering checks, tables, the property test): a copy of
an existing schedule is inserted under a new name at each position in turn, in this process, and the schedule tests
that read the registry run again: those that walk it whole, and those parametrised by name for the new name.
"""

from contextlib import contextmanager
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from parallel.pipeline.schedules import SCHEDULES, RegisteredSchedule
from parallel.pipeline.tables import load_table, main as tables_main
from tests import test_pipeline_lowered as lowered_tests, test_schedule_tables as table_tests, \
    test_schedules as schedule_tests  # modules, not their test functions: pytest would collect those here again
from tests.test_pipeline_lowered import mutants
from tests.test_schedule_agreement import agree

NAMES = list(SCHEDULES)
NEW = "copied"
# The property test at a quarter of its examples per position: the whole registry is drawn from each time.
AGREE = settings(max_examples=100, deadline=None, derandomize=True, database=None)(given(data=st.data())(agree))


@contextmanager
def registered_at(position: int, name: str, entry: RegisteredSchedule):
    """SCHEDULES, changed in place (every importer holds this dict), with `entry` as the `position`-th schedule."""
    saved = list(SCHEDULES.items())
    SCHEDULES.clear()
    SCHEDULES.update([*saved[:position], (name, entry), *saved[position:]])
    try:
        yield
    finally:
        SCHEDULES.clear()
        SCHEDULES.update(saved)


@pytest.mark.parametrize("position", range(len(NAMES) + 1))
def test_a_schedule_inserted_anywhere_leaves_the_schedule_tests_green(position, tmp_path):
    source = NAMES[position % len(NAMES)]  # every schedule is copied at some position
    before = {name: mutants(name, 3, 3, 5) for name in NAMES}
    with registered_at(position, NEW, replace(SCHEDULES[source])):
        assert list(SCHEDULES).index(NEW) == position
        assert {name: mutants(name, 3, 3, 5) for name in NAMES} == before  # seeded by name: none moved
        lowered_tests.test_random_faults_are_refused_with_the_action_named()
        schedule_tests.test_lowering_sends_after_producer_and_receives_before_consumer()
        schedule_tests.test_every_schedule_verifies_with_and_without_comm_costs(NEW)
        for suffix in ("csv", "json"):
            table_tests.test_every_builtin_schedule_dumps_and_reloads_identically(tmp_path, NEW, suffix)
        pp, vpp = 2, SCHEDULES[NEW].default_vpp
        tables_main(["dump", NEW, "--pp", str(pp), "--m", "4", "--vpp", str(vpp), "--out", str(tmp_path / "t.json")])
        assert load_table(tmp_path / "t.json")[0] == SCHEDULES[source].generate(pp, 4, vpp)
        AGREE()
    assert list(SCHEDULES) == NAMES


def test_every_torch_counterpart_an_entry_names_is_a_torch_schedule():
    # The benchmarks run each schedule against the class its entry names (scripts/bench/torch_pipe.py COUNTERPARTS).
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    named = {name: getattr(pipelining, r.torch_schedule, None) for name, r in SCHEDULES.items() if r.torch_schedule}
    assert named.keys() == set(SCHEDULES)  # torch has every one of today's schedules
    for name, cls in named.items():
        assert isinstance(cls, type) and issubclass(cls, (PipelineScheduleSingle, PipelineScheduleMulti)), name
