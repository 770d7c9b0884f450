"""The text picture of a schedule: a rank x step grid of action strings."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from fastpipe.schedules._ir import Action, Schedule

__all__ = ["render_text"]

IDLE = "."


def render_text(
    schedule: Schedule,
    by: Literal["time", "list"] = "time",
    marks: Collection[tuple[int, int]] = (),
) -> str:
    """Draw ``schedule`` as one row per rank.

    Args:
        schedule: The schedule.
        by: ``"time"``: one column per step of a simulation in which every
            compute action takes one step and transfers are free; idle steps
            show ``.`` and communication actions, which take no time, are left
            out. ``"list"``: one column per position in each rank's list,
            communication actions included; this needs no simulation, so it
            also draws schedules that deadlock.
        marks: ``(rank, list index)`` pairs to draw as ``>1F0<`` (list mode).

    Returns:
        The grid, with a title line and a header of column numbers.

    Raises:
        ScheduleError: In time mode, if the schedule deadlocks.
        ValueError: For an unknown ``by``.

    Example:
        >>> from fastpipe.schedules import build
        >>> print(build("gpipe", 2, 2).render_text())  # doctest: +NORMALIZE_WHITESPACE
        gpipe: 2 ranks, 2 stages, 2 microbatches (one column per unit-time step)
        step     0   1   2   3   4   5
        rank 0 0F0 0F1   .   . 0B0 0B1
        rank 1   . 1F0 1F1 1B0 1B1   .
    """
    if by == "time":
        cells, what = _time_cells(schedule), "one column per unit-time step"
    elif by == "list":
        cells, what = _list_cells(schedule, set(marks)), "one column per list position"
    else:
        raise ValueError(f"by must be 'time' or 'list', got {by!r}")
    title = (
        f"{schedule.name}: {schedule.ranks} ranks, {schedule.stages} stages, "
        f"{schedule.microbatches} microbatches ({what})"
    )
    columns = max((len(row) for row in cells), default=0)
    width = max([len(c) for row in cells for c in row] + [len(str(columns - 1)), 1])
    label = len(f"rank {schedule.ranks - 1}")
    lines = [title, "step".ljust(label) + "".join(f" {c:>{width}}" for c in range(columns))]
    for rank, row in enumerate(cells):
        padded = row + [""] * (columns - len(row))
        lines.append(f"rank {rank}".ljust(label) + "".join(f" {c:>{width}}" for c in padded))
    return "\n".join(line.rstrip() for line in lines)


def _time_cells(schedule: Schedule) -> list[list[str]]:
    from fastpipe.schedules._simulate import unit_costs

    sim = unit_costs(schedule)
    steps = int(sim.makespan)
    cells = [[IDLE] * steps for _ in range(schedule.ranks)]
    for rec in sim.timeline:
        if rec.track == "compute":
            cells[rec.rank][int(rec.start)] = str(rec.action)
    return cells


def _list_cells(schedule: Schedule, marks: set[tuple[int, int]]) -> list[list[str]]:
    return [
        [_cell(a, (rank, i) in marks) for i, a in enumerate(row)]
        for rank, row in enumerate(schedule.actions)
    ]


def _cell(action: Action, marked: bool) -> str:
    text = str(action) if isinstance(action, Action) else repr(action)
    return f">{text}<" if marked else text
