"""The simulator: run each rank's list in order on a model of time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fastpipe.schedules._costs import Costs, compute_cost, rank_speeds, transfer_cost
from fastpipe.schedules._ir import Action, Kind, Schedule
from fastpipe.schedules._lower import lower, matching_recv, matching_send

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Simulation", "TimelineRecord", "inflight_peaks", "simulate", "unit_costs"]


@dataclass(frozen=True)
class TimelineRecord:
    """One interval of the timeline: ``action`` ran on ``rank`` from ``start`` to ``end``.

    ``track`` is ``"compute"`` for F/B/I/W and ``"comm"`` for a transfer (a
    send's flight from the moment it is issued until it arrives). ``device``:
    a measured action's own seconds where the host's span is not its cost
    (on a GPU, between CUDA events around it: the host only queued it).
    """

    rank: int
    action: Action
    start: float
    end: float
    track: Literal["compute", "comm"] = "compute"
    device: float | None = None

    @property
    def seconds(self) -> float:
        """What the action cost: ``device`` where measured, else ``end - start``."""
        return self.end - self.start if self.device is None else self.device


@dataclass
class Simulation:
    """What :func:`simulate` measured. Times are in cost units.

    Attributes:
        schedule: The schedule that was simulated.
        makespan: When the last compute action ends.
        busy: Per rank, total compute time.
        idle: Per rank, ``makespan - busy``.
        bubble_ratio: ``sum(idle) / (ranks * makespan)``.
        interior_idle: Per rank, idle time between the rank's first start and
            its last end: the bubble left when ranks may start and finish
            staggered (the Zero Bubble paper's accounting).
        peak_inflight: Per rank, the most (stage, microbatch) pairs whose F
            has run and whose I or B has not.
        peak_held: Per rank, the most whose F has run and whose W or B has
            not: with what W reads, what a split schedule holds (``lean``
            orders keep it within their F-to-I cap).
        timeline: Compute records, then, when a P2P model was given
            (``latency != 0`` or a ``bandwidth``), comm records; each group in
            start order.
    """

    schedule: Schedule
    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_ratio: float
    interior_idle: list[float]
    peak_inflight: list[int]
    peak_held: list[int]
    timeline: list[TimelineRecord]

    def to_chrome_trace(self, path: str | Path, us_per_unit: float = 1000.0) -> Path:
        """Write a Chrome/Perfetto trace; see :func:`fastpipe.schedules._trace.to_chrome_trace`."""
        from fastpipe.schedules._trace import to_chrome_trace

        return to_chrome_trace(self, path, us_per_unit=us_per_unit)

    def plot(self, path: str | Path | None = None, ax: Axes | None = None) -> Figure:
        """Draws the timeline on a matplotlib Figure (returned), into ``ax``
        when given, saved to ``path`` when given; see
        :func:`fastpipe.schedules._plot.plot`."""
        from fastpipe.schedules._plot import plot

        return plot(self, path, ax)


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    *,
    rank_speed: Sequence[float] | None = None,
    latency: float = 0.0,
    bandwidth: float | None = None,
    message_bytes: float | Callable[[Action], float] = 0.0,
) -> Simulation:
    """Run ``schedule`` on a model of time and measure it.

    Each rank runs its (lowered) list in order. A compute action starts when
    its rank is free; a receive holds its rank until the matching send's data
    arrives, ``latency + message_bytes / bandwidth`` after the send was issued.
    Sends do not block and every transfer has its own link (no contention).
    With the defaults transfers are free, and the model is the usual one:
    an action starts when its rank is free and its inputs are ready.

    Args:
        schedule: A valid schedule (call ``validate()`` first); compute-only or
            lowered.
        costs: See :func:`fastpipe.schedules._costs.compute_cost`: ``None`` for
            F=1, B=2, I=1, W=1; a mapping kind -> number or kind -> per-stage
            numbers; or ``(action) -> float``.
        rank_speed: Per-rank speed factors; an action's duration on rank ``r``
            is ``cost / rank_speed[r]`` (heterogeneous devices).
        latency: P2P latency per transfer, in cost units.
        bandwidth: P2P bandwidth in bytes per cost unit; ``None`` ignores bytes.
        message_bytes: Bytes per transfer, or ``(send_action) -> bytes``.

    Returns:
        The :class:`Simulation`.

    Raises:
        ValueError: For bad costs, speeds or P2P parameters.
        ScheduleError: If the schedule deadlocks (or is otherwise invalid).

    Example:
        >>> from fastpipe.schedules import build
        >>> round(simulate(build("1f1b", 4, 8)).bubble_ratio, 4)  # 3 / 11
        0.2727
    """
    cost = compute_cost(costs, schedule.stages)
    speed = rank_speeds(rank_speed, schedule.ranks)
    flight = transfer_cost(latency, bandwidth, message_bytes)
    with_comm = latency != 0 or bandwidth is not None
    compute, comm = _run(schedule, lambda a, r: cost(a) / speed[r], flight)
    makespan = max((rec.end for rec in compute), default=0.0)
    busy = [0.0] * schedule.ranks
    first = [makespan] * schedule.ranks
    last = [0.0] * schedule.ranks
    for rec in compute:
        busy[rec.rank] += rec.end - rec.start
        first[rec.rank] = min(first[rec.rank], rec.start)
        last[rec.rank] = max(last[rec.rank], rec.end)
    idle = [makespan - b for b in busy]
    span = schedule.ranks * makespan
    return Simulation(
        schedule=schedule,
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_ratio=sum(idle) / span if span > 0 else 0.0,
        interior_idle=[max(0.0, e - s - b) for s, e, b in zip(first, last, busy)],
        peak_inflight=inflight_peaks(schedule),
        peak_held=inflight_peaks(schedule, until_w=True),
        timeline=sorted(compute, key=_order) + (sorted(comm, key=_order) if with_comm else []),
    )


def _order(rec: TimelineRecord) -> tuple[float, int]:
    return rec.start, rec.rank


def _run(
    schedule: Schedule,
    duration: Callable[[Action, int], float],
    flight: Callable[[Action], float],
) -> tuple[list[TimelineRecord], list[TimelineRecord]]:
    """Advance every rank as far as it can until all are done; raise if stuck."""
    rows = lower(schedule).actions
    ptr = [0] * schedule.ranks
    free = [0.0] * schedule.ranks
    arrival: dict[Action, float] = {}  # keyed by the receive that will consume it
    compute: list[TimelineRecord] = []
    comm: list[TimelineRecord] = []
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(rows):
            while ptr[rank] < len(row):
                action = row[ptr[rank]]
                t = free[rank]
                if action.kind in (Kind.RECV_F, Kind.RECV_B):
                    if action not in arrival:
                        break  # blocked until the sender gets there
                    free[rank] = max(t, arrival.pop(action))
                elif action.kind in (Kind.SEND_F, Kind.SEND_B):
                    end = t + flight(action)
                    arrival[matching_recv(action)] = end
                    comm.append(TimelineRecord(rank, action, t, end, "comm"))
                else:
                    end = t + duration(action, rank)
                    compute.append(TimelineRecord(rank, action, t, end))
                    free[rank] = end
                ptr[rank] += 1
                progress = True
    if any(p < len(row) for p, row in zip(ptr, rows)):
        _raise_stuck(schedule, rows, ptr)
    return compute, comm


def _raise_stuck(schedule: Schedule, rows: list[list[Action]], ptr: list[int]) -> None:
    from fastpipe.schedules._validate import validate

    validate(schedule)  # names the real problem when there is one
    waits = [
        f"{rows[r][p]} waits for {matching_send(rows[r][p])}"
        for r, p in enumerate(ptr)
        if p < len(rows[r])
    ]
    raise AssertionError(f"simulation stuck on a schedule that validates: {waits}")


def inflight_peaks(schedule: Schedule, until_w: bool = False) -> list[int]:
    """Per rank, the most (stage, microbatch) pairs between their F and their
    I or B (``until_w``: their W or B).

    Counted in list order, which is the rank's execution order.
    """
    ends = {Kind.B, Kind.W} if until_w else {Kind.B, Kind.I}
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for action in row:
            if action.kind is Kind.F:
                live += 1
                peak = max(peak, live)
            elif action.kind in ends:
                live -= 1
        peaks.append(peak)
    return peaks


def unit_costs(schedule: Schedule) -> Simulation:
    """Simulate with every compute action taking one step (the text grid's clock)."""
    return simulate(schedule, lambda action: 1.0)
