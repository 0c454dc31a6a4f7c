"""scripts/preview.py (what a config would do, without launching) and the timeline pictures and traces."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.pipeline.actions import Action, Costs, Kind
from parallel.pipeline.lowering import lower
from parallel.pipeline.schedules import SCHEDULES
from parallel.pipeline.simulate import simulate
from parallel.pipeline.timeline import (chrome_trace, draw_measured_vs_simulated, draw_timeline, intervals,
                                        measured_bubble)
from parallel.pipeline.trace_files import write_trace

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 1000


def load_preview_module():
    spec = importlib.util.spec_from_file_location("preview_script", REPO / "scripts" / "preview.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- scripts/preview.py. -----------------------------------------------------------------------------------


def test_preview_script_help_exits_0_with_its_usage(capsys):
    assert load_preview_module().main(["--help"]) == 0  # Hydra's override grammar never sees the flag
    out = capsys.readouterr().out
    assert "scripts/preview.py" in out and "--search" in out and "--out" in out


def test_preview_script_prints_the_preview_and_writes_a_png(tmp_path):
    out = tmp_path / "timeline.png"
    cmd = [sys.executable, "scripts/preview.py", "model=tiny", "parallel.pp=4", "schedule=1f1b",
           "schedule.n_microbatches=8", f"--out={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for line in [
        "partition: 4 stages, placement loop",
        "  stage 0 on rank 0: layer 0 (1) + embed_tokens, ",
        "  stage 1 on rank 1: layer 1 (1), ",
        "  stage 3 on rank 3: layer 3 (1) + norm + lm_head, ",
        "rank 0  | F0 F1 F2 F3 .  .  .  .  .  .  B0 -- F4 B1",
        "predicted: makespan 33 cost units, bubble fraction 27.3%",
        "  rank 0: peak live micro-batches 4, peak activation memory ",
        "  rank 3: peak live micro-batches 1, peak activation memory ",
        f"timeline: {out}",
    ]:
        assert line in text, f"{line!r} not in:\n{text}"
    # Per-stage counts add up to the model, with the tied lm_head's copy on the last stage counted once.
    per_stage = [int(n.replace(",", "")) for n in re.findall(r"stage \d on rank \d: .*, ([\d,]+) params", text)]
    total = int(re.search(r"total ([\d,]+) parameters", text).group(1).replace(",", ""))
    vocab, hidden = 2048, 64
    assert len(per_stage) == 4 and sum(per_stage) - vocab * hidden == total
    # Memory falls with the live micro-batches: 4, 3, 2, 1 of one layer each.
    memory = [int(n.replace(",", "")) for n in re.findall(r"peak activation memory ([\d,]+) bytes", text)]
    assert memory == [memory[3] * k for k in (4, 3, 2, 1)] and memory[3] > 0
    assert is_png(out)


def test_preview_defaults_to_preview_png_in_the_cwd(tmp_path, monkeypatch, capsys):
    preview = load_preview_module()
    monkeypatch.chdir(tmp_path)
    assert preview.main(["model=tiny", "parallel.pp=2", "parallel.vpp=2", "schedule=zbv",
                      "schedule.n_microbatches=4"]) == 0
    assert "placement v" in capsys.readouterr().out
    assert is_png(tmp_path / "preview.png")


def test_preview_refuses_a_bad_config_with_one_line(tmp_path, capsys):
    preview = load_preview_module()
    with pytest.raises(SystemExit) as code:
        preview.main(["model=tiny", "parallel.pp=4", "parallel.vpp=2", "schedule=interleaved-1f1b",
                   f"--out={tmp_path / 'x.png'}"])
    err = capsys.readouterr().err.strip()
    assert code.value.code == 2 and "\n" not in err and "parallel.pp*parallel.vpp = 8 stages" in err
    assert not (tmp_path / "x.png").exists()


def test_split_args_takes_out_and_leaves_overrides():
    preview = load_preview_module()
    assert preview.split_args(["a=1", "--out=x.png", "b=2"]) == (["a=1", "b=2"], Path("x.png"))
    assert preview.split_args(["--out", "y.png", "c=3"]) == (["c=3"], Path("y.png"))
    assert preview.split_args(["c=3"]) == (["c=3"], Path("preview.png"))


# --- Timelines and traces. ------------------------------------------------------------------------------


def acts(measured: dict) -> dict:
    """Hand-written measurements, `{rank: [("F0@s0", start, end), ...]}`, with Actions as traces carry them."""
    return {r: [(Action.parse(a), s, e) for a, s, e in row] for r, row in measured.items()}


def sim(name: str, pp: int = 4, m: int = 8):
    registered = SCHEDULES[name]
    vpp = registered.default_vpp
    return simulate(lower(registered.generate(pp, m, vpp), pp, pp * vpp, registered.placement), pp, pp * vpp, m,
                    registered.placement, Costs(f=1, b=2, i=1, w=1))


def test_draw_timeline_from_a_simulation_or_from_intervals(tmp_path):
    for name in ("1f1b", "zbv"):
        assert is_png(draw_timeline(sim(name), tmp_path / f"{name}.png", name))
    rows = acts({0: [("F0@s0", 0.0, 1.0), ("B0@s0", 3.0, 5.0)], 1: [("F0@s1", 1.0, 2.0), ("B0@s1", 2.0, 3.0)]})
    assert is_png(draw_timeline(rows, tmp_path / "sub" / "rows.png", "hand-made"))  # folders are created


def test_draw_measured_vs_simulated(tmp_path):
    simulated = sim("zb-h1")
    measured = {r: [(a, 0.01 * s, 0.01 * e + 0.001) for a, s, e in row]
                for r, row in intervals(simulated, comm=True).items()}
    assert is_png(draw_measured_vs_simulated(simulated, measured, tmp_path / "mvp.png", "step 3"))


def test_intervals_of_a_simulation_skip_comm_unless_asked():
    res = sim("1f1b", 2, 2)
    compute = intervals(res)
    assert [str(a) for a, _, _ in compute[1]] == ["F0@s1", "B0@s1", "F1@s1", "B1@s1"]
    assert compute[1][1] == (Action.parse("B0@s1"), 2.0, 4.0)
    assert any(a.kind is Kind.RECV_F for a, _, _ in intervals(res, comm=True)[1])


def test_chrome_trace_has_one_named_track_per_rank_and_microsecond_events():
    measured = acts({0: [("F0@s0", 10.0, 10.5), ("SEND_F0@s0", 10.5, 10.5)], 1: [("F0@s1", 10.5, 11.25)]})
    trace = chrome_trace(measured, name="step 7")
    json.dumps(trace)  # serialisable as is
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "step 7"}} in events
    spans = [e for e in events if e["ph"] == "X"]
    assert spans[0] == {"name": "F0@s0", "cat": "F", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 500000.0,
                        "args": {"microbatch": 0, "stage": 0}}
    assert spans[1]["cat"] == "comm" and spans[2]["tid"] == 1 and spans[2]["ts"] == pytest.approx(500000.0)


def test_measured_bubble_counts_only_compute_as_busy():
    measured = acts({0: [("F0@s0", 0.0, 1.0), ("RECV_B0@s0", 1.0, 3.0), ("B0@s0", 3.0, 4.0)],
                     1: [("F0@s1", 1.0, 2.0), ("B0@s1", 2.0, 3.0)]})
    assert measured_bubble(measured) == pytest.approx(1 - 4.0 / (2 * 4.0))
    assert measured_bubble({}) == 0.0
    simulated = sim("1f1b")  # a simulated step, replayed as a "measurement", gives the simulator's bubble
    assert measured_bubble(intervals(simulated, comm=True)) == pytest.approx(simulated.bubble_fraction)


def test_write_trace_writes_the_chrome_trace_and_the_picture(tmp_path):
    simulated = sim("1f1b", 2, 2)
    trace = {r: [(a, 0.5 * s, 0.5 * e) for a, s, e in row] for r, row in intervals(simulated, comm=True).items()}
    bubble = write_trace(tmp_path / "run", 3, trace, simulated)
    assert bubble == pytest.approx(simulated.bubble_fraction)  # the same step, only slower
    events = json.loads((tmp_path / "run" / "trace_step3.json").read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X" and e["tid"] == 1} >= {"F0@s1", "B1@s1", "RECV_F0@s1"}
    assert is_png(tmp_path / "run" / "trace_step3.png")


def test_preview_memory_follows_train_recompute(tmp_path, capsys):
    preview = load_preview_module()

    def memory(*extra: str) -> list[int]:
        assert preview.main(["model=tiny", "parallel.pp=2", "train.seq_len=256", *extra, f"--out={tmp_path}/p.png"]) == 0
        return [int(n.replace(",", "")) for n in re.findall(r"peak activation memory ([\d,]+) bytes",
                                                             capsys.readouterr().out)]

    none, full, selective = memory(), memory("train.recompute=full"), memory("train.recompute=selective")
    assert all(f <= 0.5 * n and f < s < n for n, f, s in zip(none, full, selective)), (none, full, selective)
