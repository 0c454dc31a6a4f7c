"""Schedules as tables: CSV/JSON round trips, clear load errors, broken tables refused before launch."""

import json

import pytest

from parallel.pipeline.actions import Action, Kind
from parallel.pipeline.lowered import load_schedule
from parallel.pipeline.lowering import lower
from parallel.pipeline.schedules import SCHEDULES
from parallel.pipeline.simulate import ScheduleError, verify
from parallel.spec import PipelineSpec
from parallel.pipeline.tables import TableError, TableMeta, dump_builtin, dump_table, load_table, main

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def launch_check(path, pp: int, m: int, vpp: int = 1) -> None:
    """What the trainer does before launch with schedule=table: load, lower, verify."""
    compute, meta = load_table(path, pp=pp, n_microbatches=m, vpp=vpp)
    verify(lower(compute, pp, pp * vpp, meta.placement), pp, pp * vpp, m, meta.placement)


# --- Round trips. ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["csv", "json"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_builtin_schedule_dumps_and_reloads_identically(tmp_path, name, suffix):
    registered = SCHEDULES[name]
    least, most = registered.vpp
    for pp in (1, 2, 3, 4):
        for vpp in (least, least + 1) if most is None else (least,):
            for m in (pp, 2 * pp) if registered.microbatches_multiple_of_pp else (1, 3, 8):
                path = tmp_path / f"{name}-{pp}-{vpp}-{m}.{suffix}"
                dump_builtin(name, pp, m, path, vpp)
                compute, meta = load_table(path, pp=pp, n_microbatches=m, vpp=vpp)
                assert compute == registered.generate(pp, m, vpp), (name, pp, vpp, m)
                assert meta == TableMeta(pp, m, vpp, registered.placement, str(path))


def test_table_is_a_readable_timeline(tmp_path):
    path = dump_builtin("1f1b", 2, 3, tmp_path / "1f1b.csv")
    assert path.read_text().splitlines() == [
        "# pp=2 n_microbatches=3 vpp=1 placement=loop",
        "rank,0,1,2,3,4,5,6,7,8,9,10,11",
        "0,F0,F1,,,B0,,F2,B1,,,B2,",  # one column per unit of time (F=1, B=2): empty cells are idle
        "1,,F0,B0,,F1,B1,,F2,B2,,,",
    ]
    zbv = json.loads(dump_builtin("zbv", 2, 2, tmp_path / "zbv.json").read_text())
    # Two stages per rank: every cell names its stage.
    assert zbv["placement"] == "v" and [c for c in zbv["ranks"][0] if c][:3] == ["F0@s0", "F1@s0", "F0@s3"]


def test_hand_written_tables_without_metadata(tmp_path):
    # No comment line: pp from the rows, micro-batches from the cells, one stage per rank.
    compute, meta = load_table(write(tmp_path, "a.csv", "rank,0,1,2,3\n0,F0,F1,B0,B1\n1,F0,B0,F1,B1\n"))
    assert meta == TableMeta(2, 2, 1, "loop", str(tmp_path / "a.csv"))
    assert compute[1] == [Action(F, 0, 1), Action(B, 0, 1), Action(F, 1, 1), Action(B, 1, 1)]
    # Named stages that only fit the V placement: placement v, two chunks per rank.
    _, meta = load_table(write(tmp_path, "v.json", json.dumps({"ranks": [
        ["F0@s0", "", "", "F0@s3", "B0@s3", "", "", "B0@s0"], ["", "F0@s1", "F0@s2", "", "", "B0@s2", "B0@s1"]]})))
    assert (meta.placement, meta.vpp, meta.n_microbatches) == ("v", 2, 1)


def test_load_schedule_handles_names_and_tables(tmp_path):
    compute, placement = load_schedule(PipelineSpec(pp=2, vpp=2, schedule="zbv", n_microbatches=4))
    assert placement == "v" and compute == SCHEDULES["zbv"].generate(2, 4, 2)
    path = dump_builtin("zb-h1", 4, 8, tmp_path / "zb.csv")
    spec = PipelineSpec(pp=4, schedule="table", n_microbatches=8, table_path=str(path))
    assert load_schedule(spec) == (SCHEDULES["zb-h1"].generate(4, 8, 1), "loop")
    with pytest.raises(ValueError, match=r"schedule=table needs schedule.path="):
        load_schedule(PipelineSpec(pp=4, schedule="table", n_microbatches=8))
    with pytest.raises(ValueError, match=r"schedule.name=nope is not a known schedule; use one of 1f1b, "):
        load_schedule(PipelineSpec(pp=4, schedule="nope", n_microbatches=8))


def test_cli_dumps_any_builtin(tmp_path, capsys):
    main(["dump", "interleaved-1f1b", "--pp", "2", "--m", "4", "--vpp", "2", "--out", str(tmp_path / "i.json")])
    assert "wrote" in capsys.readouterr().out
    assert load_table(tmp_path / "i.json")[0] == SCHEDULES["interleaved-1f1b"].generate(2, 4, 2)
    with pytest.raises(SystemExit) as code:
        main(["dump", "interleaved-1f1b", "--pp", "4", "--m", "6", "--out", str(tmp_path / "x.csv")])
    assert code.value.code == 2 and "schedule.n_microbatches" in capsys.readouterr().err


def test_broken_schedules_are_still_dumped_in_order(tmp_path):
    broken = [[Action(F, 0, 0), Action(B, 0, 0), Action(F, 1, 0), Action(B, 1, 0)],
              [Action(F, 0, 1), Action(F, 1, 1), Action(B, 0, 1), Action(B, 1, 1)]]  # deadlocks
    path = dump_table(broken, tmp_path / "broken.csv", "loop", 2, 1)
    assert load_table(path)[0] == broken


# --- Load errors: file, cell and config key named. --------------------------------------------------------


def test_load_errors_name_the_file_the_cell_and_the_key(tmp_path):
    with pytest.raises(TableError, match=r"schedule.path=.*nothere.csv: no such file"):
        load_table(tmp_path / "nothere.csv")
    with pytest.raises(TableError, match=r"unknown table format '.txt'; use .csv or .json"):
        load_table(write(tmp_path, "t.txt", ""))
    bad = write(tmp_path, "bad.csv", "rank,0,1,2\n0,F0,B0\n1,F0,X0,B0\n")
    with pytest.raises(TableError, match=r"bad.csv row 3 \(rank 1\), column 3 \(slot 1\): cannot parse action 'X0'"):
        load_table(bad)
    with pytest.raises(TableError, match=r"bad.json ranks\[1\]\[2\]: cannot parse action 'Fx'"):
        load_table(write(tmp_path, "bad.json", json.dumps({"ranks": [["F0", "B0"], ["F0", "", "Fx"]]})))
    with pytest.raises(TableError, match=r"ranks\[0\]\[1\]: 3 is not an action string"):
        load_table(write(tmp_path, "num.json", json.dumps({"ranks": [["F0", 3]]})))
    with pytest.raises(TableError, match=r"column 3 \(slot 1\): 'SEND_F0' is communication"):
        load_table(write(tmp_path, "comm.csv", "0,F0,SEND_F0,B0\n1,F0,B0\n"))
    with pytest.raises(TableError, match=r"'F0@s1' runs stage 1, but rank 0 holds stages \[0\]"):
        load_table(write(tmp_path, "own.csv", "0,F0@s1,B0\n1,F0,B0\n"))
    with pytest.raises(TableError, match=r"'F0' names no stage; write it as 'F0@s<stage>'"):
        load_table(write(tmp_path, "bare.csv", "# vpp=2\n0,F0,F0@s2\n1,F0@s1,F0@s3\n"))
    with pytest.raises(TableError, match=r"row 2, column 1: expected rank 1 in the first column, got '2'"):
        load_table(write(tmp_path, "rows.csv", "0,F0,B0\n2,F0,B0\n"))


def test_config_mismatch_names_the_config_key(tmp_path):
    path = dump_builtin("1f1b", 4, 8, tmp_path / "1f1b.csv")
    with pytest.raises(TableError, match=r"has 4 ranks but parallel.pp=2; set parallel.pp=4"):
        load_table(path, pp=2)
    with pytest.raises(TableError, match=r"written for 8 micro-batches but schedule.n_microbatches=4; "
                                         r"set schedule.n_microbatches=8"):
        load_table(path, pp=4, n_microbatches=4)
    with pytest.raises(TableError, match=r"holds 1 stage\(s\) per rank but parallel.vpp=2; set parallel.vpp=1"):
        load_table(path, pp=4, n_microbatches=8, vpp=2)
    with pytest.raises(ValueError, match=r"schedule.n_microbatches=16"):
        load_schedule(PipelineSpec(pp=4, schedule="table", n_microbatches=16, table_path=str(path)))


# --- Broken tables: each refused before launch, naming rank, slot and action. -----------------------------


def refuse(path, *fragments: str, pp: int = 2, m: int = 2, vpp: int = 1) -> None:
    with pytest.raises(ScheduleError) as err:
        launch_check(path, pp, m, vpp)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_table_with_a_missing_backward(tmp_path):
    refuse(write(tmp_path, "t.csv", "0,F0,F1,B0\n1,F0,B0,F1,B1\n"), "rank 0, slot 2, F1@s0: no backward")
    # Missing on a later stage, the earlier stage is the first to notice: its backward has no input.
    refuse(write(tmp_path, "u.csv", "0,F0,F1,B0,B1\n1,F0,B0,F1\n"),
           "rank 0, slot 6, B1@s0: its input never comes: no rank runs B1@s1 or I1@s1")


def test_table_with_a_swapped_pair_deadlocks(tmp_path):
    # Rank 1 runs F1 before B0, but rank 0 makes F1 only after B0's gradient came back from rank 1.
    refuse(write(tmp_path, "t.csv", "0,F0,B0,F1,B1\n1,F0,F1,B0,B1\n"),
           "deadlock", "rank 0, slot 2, RECV_B0@s0 waits for rank 1", "rank 1, slot 2, RECV_F1@s1 waits for rank 0")


def test_table_with_a_duplicate_forward(tmp_path):
    refuse(write(tmp_path, "t.csv", "0,F0,F0,F1,B0,B1\n1,F0,B0,F1,B1\n"), "rank 0, slot 2, F0@s0: duplicate")


def test_table_with_backward_before_forward(tmp_path):
    refuse(write(tmp_path, "t.csv", "0,F0,F1,B0,B1\n1,F0,B0,B1,F1\n"), "B1@s1: backward before its forward F1@s1")


def test_table_with_a_weight_grad_before_its_input_grad(tmp_path):
    refuse(write(tmp_path, "t.csv", "0,F0,F1,I0,W0,I1,W1\n1,F0,I0,W0,F1,W1,I1\n"),
           "rank 1, slot", "W1@s1: W without its I; it must follow I1@s1")


def test_table_with_an_input_grad_and_no_weight_grad(tmp_path):
    refuse(write(tmp_path, "t.json", json.dumps({"ranks": [["F0", "F1", "I0", "W0", "I1", "W1"],
                                                           ["F0", "I0", "W0", "F1", "I1"]]})),
           "rank 1, slot", "I1@s1: no W follows it")


def test_table_missing_a_micro_batch_the_config_asks_for(tmp_path):
    # Declared for 2 micro-batches, the config agrees, but rank 1 never runs micro-batch 1 at all.
    refuse(write(tmp_path, "t.csv", "# n_microbatches=2\n0,F0,F1,B0,B1\n1,F0,B0\n"),
           "rank 0, slot 6, B1@s0: its input never comes: no rank runs B1@s1 or I1@s1")
    refuse(write(tmp_path, "u.csv", "# n_microbatches=2\n0,F0,B0\n1,F0,B0\n"),
           "rank 0, slot 4 (end of list), F1@s0: missing")
