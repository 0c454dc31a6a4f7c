"""The model sizes the size sweep (`make bench ARGS=--sizes`) measures every comparison at: a MiniMind-3 shape (vocab
6400) varied one axis at a time around a centre, plus the cell issue 39 found compile and DP losing at.

One axis at a time rather than the full product (4 x 3 x 4 x 4 = 192 cells, hours on 2 cores): each axis's effect is
seen on its own against the same centre, and the largest cells stay within a few seconds a step on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    """One model and batch size: hidden width, decoder layers, sequence length, sequences per micro-batch."""

    hidden: int
    layers: int
    seq: int
    micro_batch_size: int
    microbatches: int = 4  # per step: a one-process run accumulates them, pp2 pipelines them, dp2 splits none

    @property
    def name(self) -> str:
        return f"h{self.hidden}-l{self.layers}-s{self.seq}-b{self.micro_batch_size}"


CENTRE = Cell(256, 4, 128, 2)
AXES = {"hidden": (128, 256, 512, 768), "layers": (2, 4, 8), "seq": (64, 128, 256, 512),
        "micro_batch_size": (1, 2, 4, 8)}
FOUND_LOSING = Cell(256, 8, 128, 2)  # issue 39's cell: compile 0.77-0.9x of eager, dp2 1.10x DDP's time


def sweep_cells() -> list[Cell]:
    """The centre, every axis value with the other axes at the centre, and the issue's cell; no cell twice."""
    cells = [CENTRE]
    for axis, values in AXES.items():
        for value in values:
            cell = Cell(**{**CENTRE.__dict__, axis: value})
            if cell not in cells:
                cells.append(cell)
    return cells + ([FOUND_LOSING] if FOUND_LOSING not in cells else [])


QUICK = [Cell(128, 2, 64, 1), CENTRE, FOUND_LOSING]  # the default `make bench` run's subset: small, centre, the issue's
