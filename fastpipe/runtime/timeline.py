"""A measured step as a ``Simulation``: the same pictures and figures as the simulator's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from fastpipe.schedules import Schedule, Simulation, TimelineRecord
from fastpipe.schedules._simulate import inflight_peaks

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["MeasuredStep", "measured"]


class MeasuredStep(Simulation):
    """A ``Simulation`` of a step that ran: its times are milliseconds, not cost units."""

    def plot(self, path: str | Path | None = None, ax: Axes | None = None) -> Figure:
        """Draw the timeline in milliseconds; see :func:`fastpipe.schedules._plot.plot`."""
        from fastpipe.schedules._plot import plot

        return plot(self, path, ax, unit="ms")


def measured(schedule: Schedule, records: Sequence[TimelineRecord]) -> MeasuredStep:
    """Builds a Simulation from real action timings.

    Args:
        schedule: the schedule that ran (compute-only or lowered).
        records: TimelineRecords in seconds since the step began, from every rank.

    Returns:
        A :class:`MeasuredStep` whose times are milliseconds (so
        ``to_chrome_trace`` with its default scale writes real microseconds,
        and ``plot`` labels its axis in ms) and whose bubble ratio is the
        measured idle share of the compute tracks.

    Raises:
        ValueError: If ``records`` holds no compute record.
    """
    ms = [replace(r, start=r.start * 1e3, end=r.end * 1e3) for r in records]
    compute = [r for r in ms if r.track == "compute"]
    if not compute:
        raise ValueError("no compute records: was the step recorded?")
    makespan = max(r.end for r in compute)
    ranks = schedule.ranks
    busy = [0.0] * ranks
    first = [makespan] * ranks
    last = [0.0] * ranks
    for r in compute:
        busy[r.rank] += r.end - r.start
        first[r.rank] = min(first[r.rank], r.start)
        last[r.rank] = max(last[r.rank], r.end)
    idle = [makespan - b for b in busy]
    return MeasuredStep(
        schedule=schedule,
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_ratio=sum(idle) / (ranks * makespan),
        interior_idle=[max(0.0, last[k] - first[k] - busy[k]) for k in range(ranks)],
        peak_inflight=inflight_peaks(schedule),
        peak_held=inflight_peaks(schedule, until_w=True),
        timeline=sorted(compute, key=lambda r: r.start) + sorted(
            (r for r in ms if r.track == "comm"), key=lambda r: r.start
        ),
    )
