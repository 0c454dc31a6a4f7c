"""Pictures and traces of a pipeline step: simulated or measured, as PNG timelines or Chrome traces.

A measured step is `{rank: [(action, start_s, end_s), ...]}` with `Action` objects and times from one clock
shared by all ranks (e.g. `time.time()` after a barrier).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from .actions import Action
from .simulate import SimResult

__all__ = ["COLORS", "chrome_trace", "draw_measured_vs_simulated", "draw_timeline", "intervals", "measured_bubble"]

Interval = tuple[Action, float, float]  # (action, start, end)
Intervals = Mapping[int, Sequence[Interval]] | Sequence[Sequence[Interval]]

COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3", "comm": "#BBBBBB"}


def intervals(source: SimResult | Intervals, comm: bool = False) -> dict[int, list[Interval]]:
    """Per-rank (action, start, end) of a simulated step or of given intervals; comm actions only if asked."""
    if isinstance(source, SimResult):
        return {r: [(a, source.start[r][k], source.end[r][k]) for k, a in enumerate(actions)
                    if comm or not a.kind.is_comm]
                for r, actions in enumerate(source.actions)}
    rows = source.items() if isinstance(source, Mapping) else enumerate(source)
    return {int(r): [(a, float(s), float(e)) for a, s, e in row if comm or not a.kind.is_comm] for r, row in rows}


def measured_bubble(measured: Intervals) -> float:
    """1 - busy / (ranks * span): busy is time in F/B/I/W, span from the first start to the last end."""
    rows = intervals(measured, comm=True)
    times = [t for row in rows.values() for _, s, e in row for t in (s, e)]
    if not rows or not times or max(times) <= min(times):
        return 0.0
    busy = sum(e - s for row in rows.values() for a, s, e in row if not a.kind.is_comm)
    return 1.0 - busy / (len(rows) * (max(times) - min(times)))


def chrome_trace(measured: Intervals, name: str = "pipeline step") -> dict:
    """Chrome-trace JSON (chrome://tracing, Perfetto): one named track per rank, one "X" event per action."""
    rows = intervals(measured, comm=True)
    t0 = min((s for row in rows.values() for _, s, _ in row), default=0.0)
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": name}}]
    for rank in sorted(rows):
        events += [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}},
        ]
        events += [{"name": str(a), "cat": _category(a), "ph": "X", "pid": 0, "tid": rank,
                    "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6,
                    "args": {"microbatch": a.microbatch, "stage": a.stage}}
                   for a, start, end in rows[rank]]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def draw_timeline(source: SimResult | Intervals, path: str | Path, title: str = "", unit: str = "") -> Path:
    """Write a PNG: one row per rank, a colored box per F/B/I/W action with its micro-batch number."""
    plt = _pyplot()
    rows = intervals(source)
    fig, ax = plt.subplots(figsize=_size(rows, 1))
    _draw(ax, rows, _heading(source, title), unit or _unit(source))
    _legend(fig, rows)
    return _save(fig, path)


def draw_measured_vs_simulated(simulated: SimResult | Intervals, measured: Intervals, path: str | Path,
                               title: str = "") -> Path:
    """Write a PNG with two panels: the simulated step above, the measured one below."""
    plt = _pyplot()
    sim_rows, real_rows = intervals(simulated), intervals(measured)
    width, height = _size(sim_rows if len(sim_rows) >= len(real_rows) else real_rows, 2)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(width, height))
    _draw(top, sim_rows, _heading(simulated, "simulated"), _unit(simulated))
    _draw(bottom, real_rows, _heading(measured, "measured"), "seconds")
    if title:
        fig.suptitle(title)
    _legend(fig, sim_rows, real_rows)
    return _save(fig, path)


# --- Drawing helpers. -----------------------------------------------------------------------------------


def _category(a: Action) -> str:
    """F, B, I, W, or comm (SEND_*/RECV_*, which never count as busy): the color and the trace category."""
    return "comm" if a.kind.is_comm else a.kind.value


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes or in CI
    import matplotlib.pyplot as plt

    return plt


def _size(rows: dict[int, list[Interval]], panels: int) -> tuple[float, float]:
    most = max((len(row) for row in rows.values()), default=1)
    return min(28.0, max(10.0, most * 0.32)), panels * (1.2 + 0.45 * max(len(rows), 1))


def _unit(source: object) -> str:
    return "time (cost units)" if isinstance(source, SimResult) else "seconds"


def _heading(source: SimResult | Intervals, title: str) -> str:
    if isinstance(source, SimResult):
        stats = f"makespan {source.makespan:g}, bubble {source.bubble_fraction:.1%}"
    else:
        stats = f"bubble {measured_bubble(source):.1%}"
    return f"{title}: {stats}" if title else stats


def _draw(ax, rows: dict[int, list[Interval]], title: str, unit: str) -> None:
    """Boxes per rank (rank 0 on top), shaded lighter for a rank's later laps, micro-batch number inside."""
    t0 = min((s for row in rows.values() for _, s, _ in row), default=0.0)
    span = max((e for row in rows.values() for _, _, e in row), default=1.0) - t0 or 1.0
    most = max((len(row) for row in rows.values()), default=1)
    fontsize = max(4.0, min(9.0, 700.0 / most))
    for rank, row in rows.items():
        lap_of = _laps(row)
        boxes: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (kind, lap) -> (left, width) per box
        for a, start, end in row:
            lap = lap_of[a.stage]
            boxes.setdefault((_category(a), lap), []).append((start - t0, end - start))
            if (end - start) / span > 0.004:
                ax.text((start + end) / 2 - t0, rank, str(a.microbatch), ha="center", va="center",
                        fontsize=fontsize, color="white" if lap == 0 else "black")
        # One collection per color and rank: a pp=64 step has ~10^5 boxes, which one patch each would take
        # minutes to draw.
        dense = len(row) > 200  # boxes a pixel or two wide: white edges and antialiasing would wash them out
        for (kind, lap), spans in boxes.items():
            color = _lighter(COLORS[kind], min(0.6, 0.35 * lap))
            ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=color, edgecolor="white",
                           linewidth=0.0 if dense else 0.5, antialiased=not dense)
    ax.set_yticks(sorted(rows), [f"rank {r}" for r in sorted(rows)])
    ax.set_ylim(max(rows, default=0) + 0.6, min(rows, default=0) - 0.6)  # rank 0 on top
    ax.set_xlim(0, span)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _legend(fig, *row_sets: dict[int, list[Interval]]) -> None:
    from matplotlib.patches import Patch

    kinds = {_category(a) for rows in row_sets for row in rows.values() for a, _, _ in row}
    several_laps = any(len(_laps(row)) > 1 for rows in row_sets for row in rows.values())
    names = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}
    handles = [Patch(color=COLORS[k], label=names[k]) for k in "FBIW" if k in kinds]
    if several_laps:
        handles.append(Patch(color=_lighter("#777777", 0.35), label="later lap (lighter)"))
    fig.legend(handles=handles, loc="lower center", ncol=max(len(handles), 1), fontsize=8, frameon=False)


def _laps(row: list[Interval]) -> dict[int, int]:
    """Stage -> its lap: which of the rank's stages it is (0 = its lowest), from the stages its actions name."""
    return {s: i for i, s in enumerate(sorted({a.stage for a, _, _ in row}))}


def _lighter(color: str, amount: float) -> tuple[float, float, float]:
    """Mix a hex color with white."""
    rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * amount for c in rgb)  # type: ignore[return-value]


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
