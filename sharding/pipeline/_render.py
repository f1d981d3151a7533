"""Drawing a schedule: the text diagram (`render`), a rich table, and cell labels."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from sharding.pipeline._kinds import Action, Cell, Kind


def render(schedule: Any) -> str:
    """The pipeline diagram: one row per stage, one column per tick, cells ``F3``, ``F3B0``, ``.``.

    gpipe and circular show the forward scan, ``|``, then autodiff's reversed backward scan.
    """
    head, rows, split = _diagram(schedule)
    ticks = [str(k if split is None or k < split else k - split) for k in range(len(rows[0]))]
    cells = labels(rows, schedule.repeats > 1)
    width = max(len(c) for row in [ticks, *cells] for c in row)
    left = len(f"stage {schedule.stages - 1}")

    def line(name: str, cells: list[str]) -> str:
        cols = [c.rjust(width) for c in cells]
        if split is not None:
            cols.insert(split, "|")
        return f"{name.ljust(left)} {' '.join(cols)}".rstrip()

    body = [line(f"stage {s}", row) for s, row in enumerate(cells)]
    return "\n".join([head, line("tick", ticks), *body])


def _diagram(schedule: Any) -> tuple[str, list[list[Cell]], int | None]:
    """Title, per-stage rows over the whole step, and the column where the backward scan starts."""
    s, split = schedule, (None if schedule.explicit else schedule.ticks)
    head = f"{s.name}: stages={s.stages} microbatches={s.microbatches}"
    head += f" repeats={s.repeats}" if s.repeats > 1 else ""
    head += f" ticks={s.ticks} bubble={s.bubble_fraction:.1%}"
    head += " (forward scan | backward scan: autodiff, reversed)" if split else ""
    grid = s.table + s.backward_table
    return head, [[row[k] for row in grid] for k in range(s.stages)], split


def labels(grid: Any, repeats: bool) -> list[list[str]]:
    """Each cell's label: its actions' (``F3B0``), ``.`` when idle."""

    def label(cell: Any) -> str:
        if isinstance(cell, Action):
            return cell.label(repeats)
        return "".join(a.label(repeats) for a in cell) or "."

    return [[label(c) for c in row] for row in grid]


def rich_table(schedule: Any) -> Table:
    """The diagram as a rich `Table`: forwards cyan, backwards magenta, weight gradients green."""
    head, rows, split = _diagram(schedule)
    table = Table(title=head, title_justify="left", box=None, pad_edge=False)
    table.add_column("tick")
    for k in range(len(rows[0])):
        t = k if split is None or k < split else k - split
        table.add_column(("| " if k == split else "") + str(t), justify="right")
    colours = {Kind.FORWARD: "bold cyan", Kind.BACKWARD: "bold magenta",
               Kind.WEIGHT: "bold green"}  # fmt: skip
    for s, row in enumerate(rows):
        cells = []
        for cell in row:
            text = Text()
            for a in cell:
                text.append(a.label(schedule.repeats > 1), style=colours[a.kind])
            cells.append(text if cell else Text(".", style="dim"))
        table.add_row(f"stage {s}", *cells)
    return table
