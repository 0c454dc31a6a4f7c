"""Schedules as tables: a rank x time-slot grid of compute actions in CSV or JSON, loaded, checked and dumped.

CSV: an optional first line `# pp=4 n_microbatches=8 vpp=1 placement=loop`, a header `rank,0,1,2,...`,
then one row per rank: its number, then one cell per slot (`F3`, `B3`, `I3`, `W3`; `F3@s5` where the rank
holds more than one stage; empty = idle). JSON: {"pp", "n_microbatches", "vpp", "placement",
"ranks": [["F0", "", "B0", ...], ...]}. Only the order of a rank's cells matters (the lowering and the
runtime run each list as fast as its inputs allow); slots only make the table readable as a timeline.

    python -m parallel.pipeline.tables dump 1f1b --pp 4 --m 8 --out 1f1b.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .actions import Action, Costs, Schedule
from .static_rules import ScheduleError
from .lowering import lower
from .partition import PLACEMENTS, rank_stages, stage_to_rank
from .schedules import SCHEDULES, find_schedule
from .simulate import simulate

__all__ = ["TableError", "TableMeta", "dump_builtin", "dump_table", "load_table"]

_META_RE = re.compile(r"(\w+)=(\w+)")
Cells = list[tuple[int, str]]  # (column index, text)


class TableError(ValueError):
    """A schedule table that cannot be read or does not fit the config; the message names file, cell and key."""


@dataclass(frozen=True)
class TableMeta:
    """What a table is written for: pipeline ranks, micro-batches, chunks per rank and stage placement."""

    pp: int
    n_microbatches: int
    vpp: int
    placement: str
    path: str = ""


def load_table(
    path: str | Path, pp: int | None = None, n_microbatches: int | None = None, vpp: int | None = None
) -> tuple[Schedule, TableMeta]:
    """Read a CSV/JSON table into per-rank compute lists; with pp/n_microbatches/vpp given, check they match."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"schedule.path={path}: no such file; give the path of a .csv or .json schedule table")
    if path.suffix.lower() == ".json":
        rows, declared = _read_json(path)
    elif path.suffix.lower() == ".csv":
        rows, declared = _read_csv(path)
    else:
        raise TableError(f"schedule.path={path}: unknown table format {path.suffix!r}; use .csv or .json")

    n_ranks = len(rows)
    if n_ranks == 0:
        raise TableError(f"{path}: the table has no rank rows")
    placement = str(declared.get("placement", "") or _guess_placement(rows, n_ranks))
    if placement not in PLACEMENTS:
        raise TableError(f"{path}: placement={placement!r}; use one of {', '.join(PLACEMENTS)}")
    table_vpp = int(declared.get("vpp") or _guess_vpp(rows, n_ranks, placement))
    if placement == "v" and table_vpp != 2:
        raise TableError(f"{path}: the V placement holds two stages per rank, but the table declares vpp={table_vpp}")
    table_pp = int(declared.get("pp") or n_ranks)
    if table_pp != n_ranks:
        raise TableError(f"{path}: declares pp={table_pp} but has {n_ranks} rank rows")

    compute = [_read_row(path, r, row, n_ranks, table_vpp, placement) for r, row in enumerate(rows)]
    used = 1 + max((a.microbatch for actions in compute for a in actions), default=-1)
    table_m = int(declared.get("n_microbatches") or used)
    if used > table_m:
        raise TableError(f"{path}: uses micro-batch {used - 1} but declares n_microbatches={table_m}")
    meta = TableMeta(n_ranks, table_m, table_vpp, placement, str(path))
    _check_fits(meta, pp, n_microbatches, vpp)
    return compute, meta


def _read_row(path: Path, r: int, row: tuple[object, Cells], pp: int, vpp: int, placement: str) -> list[Action]:
    """Rank r's compute actions, in cell order; a cell that cannot be one names itself and the fix."""
    where, cells = row
    stages = rank_stages(r, pp, vpp, placement)
    default = stages[0] if len(stages) == 1 else None  # a bare `F3` only where the rank has one stage
    actions = []
    for col, text in cells:
        if not text.strip():
            continue
        cell = f"{path} {where(col)}"
        try:
            a = Action.parse(text, stage=default)
        except ValueError as error:
            raise TableError(f"{cell}: {error}") from None
        if a.kind.is_comm:
            raise TableError(f"{cell}: {text!r} is communication; tables hold compute actions (F, B, I, W) "
                             f"only, the lowering adds SEND/RECV")
        if a.stage not in stages:
            raise TableError(f"{cell}: {text!r} runs stage {a.stage}, but rank {r} holds stages {stages} "
                             f"({placement} placement, pp={pp}, vpp={vpp})")
        actions.append(a)
    return actions


def _check_fits(meta: TableMeta, pp: int | None, n_microbatches: int | None, vpp: int | None) -> None:
    """The config must run the table as written: same ranks, micro-batches and chunks per rank."""
    where = f"schedule table {meta.path}"
    if pp is not None and pp != meta.pp:
        raise TableError(f"{where} has {meta.pp} ranks but parallel.pp={pp}; set parallel.pp={meta.pp}")
    if n_microbatches is not None and n_microbatches != meta.n_microbatches:
        raise TableError(f"{where} is written for {meta.n_microbatches} micro-batches but "
                         f"schedule.n_microbatches={n_microbatches}; set schedule.n_microbatches={meta.n_microbatches}")
    if vpp is not None and vpp != meta.vpp:
        raise TableError(f"{where} holds {meta.vpp} stage(s) per rank but parallel.vpp={vpp}; "
                         f"set parallel.vpp={meta.vpp}")



def _read_csv(path: Path) -> tuple[list[tuple[object, Cells]], dict]:
    """Rows of (cell locator, cells) and the `# key=value` metadata of a CSV table."""
    declared: dict = {}
    lines = path.read_text().splitlines()
    body = []
    for n, line in enumerate(lines, start=1):
        if line.lstrip().startswith("#"):
            declared.update(_META_RE.findall(line))
        elif line.strip():
            body.append((n, line))
    rows = []
    records = list(zip((n for n, _ in body), csv.reader(line for _, line in body)))
    if records and records[0][1] and records[0][1][0].strip().lower() == "rank":
        records = records[1:]  # the header: rank,0,1,2,...
    for expected, (n, record) in enumerate(records):
        first = record[0].strip() if record else ""
        if first != str(expected):
            raise TableError(f"{path} row {n}, column 1: expected rank {expected} in the first column, got {first!r}")
        rows.append((lambda col, n=n, r=expected: f"row {n} (rank {r}), column {col + 2} (slot {col})",
                     list(enumerate(record[1:]))))
    return rows, declared


def _read_json(path: Path) -> tuple[list[tuple[object, Cells]], dict]:
    """Rows of (cell locator, cells) and the metadata of a JSON table."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise TableError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
        raise TableError(f'{path}: expected an object with "ranks": [[...], ...] (one list of cells per rank)')
    rows = []
    for r, cells in enumerate(data["ranks"]):
        if not isinstance(cells, list):
            raise TableError(f"{path} ranks[{r}]: expected a list of action strings")
        for col, cell in enumerate(cells):
            if cell is not None and not isinstance(cell, str):
                raise TableError(f"{path} ranks[{r}][{col}]: {cell!r} is not an action string like 'F3'")
        rows.append((lambda col, r=r: f"ranks[{r}][{col}]", [(c, cell or "") for c, cell in enumerate(cells)]))
    declared = {key: data[key] for key in ("pp", "n_microbatches", "vpp", "placement") if data.get(key) is not None}
    return rows, declared


def _stages_named(rows: list[tuple[object, Cells]]) -> list[set[int]]:
    """Stages named explicitly (`@s<stage>`) in each rank's cells."""
    return [{int(m) for _, text in cells for m in re.findall(r"@s(\d+)", text)} for _, cells in rows]


def _guess_placement(rows: list[tuple[object, Cells]], pp: int) -> str:
    """`v` if the named stages only fit the V placement, else `loop` (the default, also for bare actions)."""
    named = [(r, s) for r, stages in enumerate(_stages_named(rows)) for s in stages]
    if all(s % pp == r for r, s in named):
        return "loop"
    return "v" if all(s < 2 * pp and stage_to_rank(s, pp, "v") == r for r, s in named) else "loop"


def _guess_vpp(rows: list[tuple[object, Cells]], pp: int, placement: str) -> int:
    """Chunks per rank: from the highest stage named, 1 when no cell names a stage."""
    if placement == "v":
        return 2
    top = max((s for stages in _stages_named(rows) for s in stages), default=0)
    return top // pp + 1


# --- Dumping. -------------------------------------------------------------------------------------------


def dump_table(
    schedule: Schedule,
    path: str | Path,
    placement: str = "loop",
    n_microbatches: int | None = None,
    vpp: int | None = None,
    costs: Costs | None = None,
) -> Path:
    """Write compute lists as a CSV or JSON table (by suffix), one column per time quantum of a simulated run."""
    path = Path(path)
    pp = len(schedule)
    m = n_microbatches or 1 + max((a.microbatch for actions in schedule for a in actions), default=-1)
    vpp = vpp or (2 if placement == "v" else 1 + max((a.stage // pp for row in schedule for a in row), default=0))
    one_stage = vpp == 1  # then every cell is written bare: `F3`
    grid = _slots(schedule, pp, pp * vpp, placement, costs)
    cells = [[("" if a is None else f"{a.kind.value}{a.microbatch}" if one_stage else str(a)) for a in row]
             for row in grid]
    if path.suffix.lower() == ".json":  # one rank per line, so that the file reads as a grid
        head = ", ".join(f'"{k}": {json.dumps(v)}' for k, v in
                         {"pp": pp, "n_microbatches": m, "vpp": vpp, "placement": placement}.items())
        ranks = ",\n  ".join(json.dumps(row) for row in cells)
        path.write_text(f'{{{head},\n "ranks": [\n  {ranks}\n ]\n}}\n')
    elif path.suffix.lower() == ".csv":
        width = max((len(row) for row in cells), default=0)
        with path.open("w", newline="") as f:
            f.write(f"# pp={pp} n_microbatches={m} vpp={vpp} placement={placement}\n")
            out = csv.writer(f, lineterminator="\n")
            out.writerow(["rank", *range(width)])
            for r, row in enumerate(cells):
                out.writerow([r, *row, *[""] * (width - len(row))])
    else:
        raise TableError(f"{path}: unknown table format {path.suffix!r}; use .csv or .json")
    return path


def _slots(schedule: Schedule, pp: int, n_stages: int, placement: str, costs: Costs | None) -> list[list]:
    """Each rank's actions at their simulated start column (None = idle); in plain order if it cannot run."""
    costs = costs or Costs()
    try:
        lowered = lower(schedule, pp, n_stages, placement, costs)
        m = 1 + max((a.microbatch for row in schedule for a in row), default=-1)
        res = simulate(lowered, pp, n_stages, m, placement, costs)
    except (ScheduleError, ValueError):
        return [list(row) for row in schedule]  # a broken schedule is still worth writing down
    quantum = min(c for c in (costs.f, costs.b, costs.i, costs.w) if c > 0)
    grid: list[list] = []
    for r, row in enumerate(lowered):
        cols: list = []
        for k, a in enumerate(row):
            if a.kind.is_comm:
                continue
            col = max(round(res.start[r][k] / quantum), len(cols))  # never overwrite, keep the order
            cols += [None] * (col - len(cols)) + [a]
        grid.append(cols + [None] * (round(res.makespan / quantum) - len(cols)))  # idle to the end of the step
    return grid


def dump_builtin(name: str, pp: int, n_microbatches: int, path: str | Path, vpp: int | None = None) -> Path:
    """Dump a registered schedule, or one from a module (`pkg.mod:fn`); vpp defaults to the least it accepts."""
    registered = find_schedule(name)
    vpp = vpp or registered.default_vpp
    registered.check(name, pp, n_microbatches, vpp)
    compute = registered.generate(pp, n_microbatches, vpp)
    return dump_table(compute, path, registered.placement, n_microbatches, vpp)


def main(argv: list[str] | None = None) -> None:
    """`python -m parallel.pipeline.tables dump <name> --pp 4 --m 8 [--vpp 2] --out x.csv`."""
    parser = argparse.ArgumentParser(prog="python -m parallel.pipeline.tables", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="write a built-in schedule as a CSV/JSON table")
    dump.add_argument("name", choices=sorted(SCHEDULES))
    dump.add_argument("--pp", type=int, required=True)
    dump.add_argument("--m", "--n-microbatches", dest="m", type=int, required=True)
    dump.add_argument("--vpp", type=int, default=None)
    dump.add_argument("--out", required=True, help="x.csv or x.json")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {dump_builtin(args.name, args.pp, args.m, args.out, args.vpp)}")
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
