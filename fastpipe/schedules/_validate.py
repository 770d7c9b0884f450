"""The validator: is a schedule complete, well ordered and free of deadlock?"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection
from typing import NoReturn

from fastpipe.schedules._ir import Action, Kind, Schedule
from fastpipe.schedules._lower import lower, matching_send
from fastpipe.schedules._render import render_text

__all__ = ["ScheduleError", "validate"]


class ScheduleError(ValueError):
    """A schedule that cannot run as written.

    The message is the problem, then the schedule's grid (one column per list
    position) with the offending actions drawn as ``>1F0<``.

    Attributes:
        problem: The first line of the message, without the grid.
        grid: The marked grid.
    """

    def __init__(self, problem: str, grid: str) -> None:
        super().__init__(f"{problem}\n{grid}")
        self.problem = problem
        self.grid = grid


def validate(schedule: Schedule) -> None:
    """Check ``schedule``; return quietly if it can run, raise otherwise.

    In order: every action names a stage and microbatch in range and sits on
    its stage's rank; each (stage, microbatch) has exactly one F and either one
    B or one I plus one W; on each rank F comes before its I or B, I before its
    W, and dependencies between stages on the same rank come first; in a
    lowered schedule the sends and receives are exactly those ``lower`` would
    insert, each on the right side of its compute; and, with non-blocking sends
    and blocking receives, no set of ranks waits on each other forever.

    Args:
        schedule: Compute-only or lowered.

    Raises:
        ScheduleError: For the first problem found.

    Example:
        >>> from fastpipe.schedules import build
        >>> validate(build("zbv", 4, 8))
    """
    _check_sizes(schedule)
    _check_placement(schedule)
    _check_counts(schedule)
    _check_local_order(schedule)
    if schedule.is_lowered:
        _check_comms(schedule)
    _check_deadlock(schedule)


def _fail(schedule: Schedule, problem: str, marks: Collection[tuple[int, int]] = ()) -> NoReturn:
    raise ScheduleError(problem, render_text(schedule, by="list", marks=marks))


def _check_sizes(schedule: Schedule) -> None:
    for name in ("ranks", "stages", "microbatches"):
        value = getattr(schedule, name)
        if not isinstance(value, int) or value < 1:
            _fail(schedule, f"{name} must be an int >= 1, got {value!r}")


def _check_placement(schedule: Schedule) -> None:
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if not isinstance(a, Action) or not isinstance(a.kind, Kind):
                _fail(schedule, f"rank {rank} position {i} holds {a!r}, not an Action", [(rank, i)])
            if not 0 <= a.stage < schedule.stages:
                _fail(
                    schedule,
                    f"{a} on rank {rank}: stage outside range({schedule.stages})",
                    [(rank, i)],
                )
            if not 0 <= a.microbatch < schedule.microbatches:
                _fail(
                    schedule,
                    f"{a} on rank {rank}: microbatch outside range({schedule.microbatches})",
                    [(rank, i)],
                )
            if schedule.stage_to_rank[a.stage] != rank:
                _fail(
                    schedule,
                    f"{a} is on rank {rank} but stage {a.stage} lives on rank "
                    f"{schedule.stage_to_rank[a.stage]}",
                    [(rank, i)],
                )


def _positions(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """Where each action first appears, as (rank, index)."""
    where: dict[Action, tuple[int, int]] = {}
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            where.setdefault(a, (rank, i))
    return where


def _check_counts(schedule: Schedule) -> None:
    seen: dict[Action, tuple[int, int]] = {}
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if a in seen:
                _fail(schedule, f"{a} appears twice on rank {rank}", [seen[a], (rank, i)])
            seen[a] = (rank, i)
    for s in range(schedule.stages):
        for j in range(schedule.microbatches):
            _check_one(schedule, seen, s, j)


def _check_one(schedule: Schedule, seen: dict[Action, tuple[int, int]], s: int, j: int) -> None:
    f, b, i, w = (seen.get(Action(s, k, j)) for k in (Kind.F, Kind.B, Kind.I, Kind.W))
    present = [p for p in (f, b, i, w) if p is not None]
    where = f"stage {s} microbatch {j} (rank {schedule.stage_to_rank[s]})"
    if f is None:
        _fail(schedule, f"{where} has no F ({s}F{j} is missing)", present)
    if b is not None and (i is not None or w is not None):
        _fail(schedule, f"{where} has both B and I/W: use B alone or I plus W", present)
    if b is None and i is None:
        _fail(schedule, f"{where} has no backward: needs {s}B{j}, or {s}I{j} and {s}W{j}", [f])
    if i is not None and w is None:
        _fail(schedule, f"{where} has {s}I{j} but no {s}W{j} (missing W)", [i])
    if w is not None and i is None:
        _fail(schedule, f"{where} has {s}W{j} but no {s}I{j}", [w])


def _backward(where: dict[Action, tuple[int, int]], s: int, j: int) -> Action:
    b = Action(s, Kind.B, j)
    return b if b in where else Action(s, Kind.I, j)


def _needs(schedule: Schedule, a: Action, where: dict[Action, tuple[int, int]]) -> list[Action]:
    """The compute actions ``a`` needs that live on ``a``'s own rank."""
    s, j, place = a.stage, a.microbatch, schedule.stage_to_rank
    if a.kind is Kind.F:
        return [Action(s - 1, Kind.F, j)] if s > 0 and place[s - 1] == place[s] else []
    if a.kind is Kind.W:
        return [Action(s, Kind.I, j)]
    needs = [Action(s, Kind.F, j)]
    if s < schedule.stages - 1 and place[s + 1] == place[s]:
        needs.append(_backward(where, s + 1, j))
    return needs


def _check_local_order(schedule: Schedule) -> None:
    where = _positions(schedule)
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if not a.kind.is_compute:
                continue
            for need in _needs(schedule, a, where):
                if where[need][1] > i:
                    _fail(
                        schedule,
                        f"{a} on rank {rank} runs before {need}, which it needs "
                        f"and which comes later on the same rank",
                        [(rank, i), where[need]],
                    )


def _check_comms(schedule: Schedule) -> None:
    compute = dataclasses.replace(
        schedule, actions=[[a for a in row if a.kind.is_compute] for row in schedule.actions]
    )
    expected = lower(compute).actions
    where = _positions(schedule)
    for rank, (row, want) in enumerate(zip(schedule.actions, expected)):
        have, need = (
            Counter(a for a in row if not a.kind.is_compute),
            Counter(a for a in want if not a.kind.is_compute),
        )
        for extra in have - need:
            _fail(
                schedule, f"{extra} on rank {rank} matches no cross-rank transfer", [where[extra]]
            )
        for missing in need - have:
            owner = _owner(missing, where)
            _fail(schedule, f"rank {rank} lacks {missing}, which {owner} needs", [where[owner]])
        for i, a in enumerate(row):
            if not a.kind.is_compute and not _comm_in_place(a, i, where):
                owner = _owner(a, where)
                side = "before" if a.kind in (Kind.RECV_F, Kind.RECV_B) else "after"
                _fail(
                    schedule,
                    f"{a} on rank {rank} must come {side} {owner}",
                    [(rank, i), where[owner]],
                )


def _owner(comm: Action, where: dict[Action, tuple[int, int]]) -> Action:
    """The compute action a send follows or a receive precedes."""
    s, j = comm.stage, comm.microbatch
    return (
        Action(s, Kind.F, j) if comm.kind in (Kind.SEND_F, Kind.RECV_F) else _backward(where, s, j)
    )


def _comm_in_place(comm: Action, index: int, where: dict[Action, tuple[int, int]]) -> bool:
    owner = where[_owner(comm, where)][1]
    return index < owner if comm.kind in (Kind.RECV_F, Kind.RECV_B) else index > owner


def _check_deadlock(schedule: Schedule) -> None:
    rows = lower(schedule).actions
    ptr = [0] * schedule.ranks
    sent: set[Action] = set()
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(rows):
            while ptr[rank] < len(row):
                a = row[ptr[rank]]
                if a.kind in (Kind.RECV_F, Kind.RECV_B) and matching_send(a) not in sent:
                    break
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    sent.add(a)
                ptr[rank] += 1
                progress = True
    stuck = [(rank, ptr[rank]) for rank, row in enumerate(rows) if ptr[rank] < len(row)]
    if stuck:
        _report_deadlock(schedule, rows, stuck)


def _report_deadlock(
    schedule: Schedule, rows: list[list[Action]], stuck: list[tuple[int, int]]
) -> None:
    waits, marks = [], []
    for rank, i in stuck:
        recv = rows[rank][i]
        send = matching_send(recv)
        # Mark what the user wrote: the receive itself in a lowered schedule,
        # else the compute action that the inserted receive feeds.
        target = recv if schedule.is_lowered else rows[rank][i + 1]
        marks.append((rank, schedule.actions[rank].index(target)))
        waits.append(
            f"rank {rank} waits at {target} for {send} from rank "
            f"{schedule.stage_to_rank[send.stage]}"
        )
    _fail(schedule, "deadlock: no rank can progress; " + "; ".join(waits), marks)
