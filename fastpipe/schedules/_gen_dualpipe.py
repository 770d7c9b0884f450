"""DualPipeV (DeepSeek 2025): DualPipe cut in half, a V of two chunks per rank.

Rank ``r`` holds chunk 0 = stage ``r`` (data going down the ranks) and chunk
1 = stage ``2 p - 1 - r`` (coming back up). Each rank's list is a fixed
program of eight phases, written with ``F0`` for "the next forward of chunk
0", ``B1`` for "the next full backward of chunk 1", ``I``/``W`` for a
backward split in two, and so on (counts for ``m >= 2 p - 1``):

    1. ``2 (p - 1 - r)`` x F0                 fill: chunk 0 runs ahead
    2. ``r + 1``        x F0 F1               both directions start
    3. ``p - 1 - r``    x I1 W F1             split backward, W at once
    4. ``m - 2 p + r + 1`` x F0 B1 F1 B0      steady state: each F paired
                                              with the other direction's B
                                              (DualPipe overlaps each pair)
    5. ``p - 1 - r``    x B1 F1 B0
    6. ``r + 1``        x B1 B0               second half as I, W deferred
    7. ``p - 1 - r``    x W I0                deferred W fill the drain
    8. every W still owed

Each slot takes its chunk's next microbatch and is skipped once the chunk has
none left, which keeps the program valid for any ``m >= 1`` (for
``m < 2 p - 1`` phase 4 is empty and later phases run short).
"""

from __future__ import annotations

from collections import deque

from fastpipe.schedules._ir import Action, Kind, Schedule
from fastpipe.schedules._placement import v_placement

__all__ = ["dualpipev"]


def dualpipev(ranks: int, microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """DualPipeV as F/B/I/W lists (the module docstring has the program).

    DualPipe's overlapped forward-and-backward pairs are written as a forward
    followed by a backward on the same rank; an executor that can overlap
    them may do so. At F = 1, B = 2 (I = W = 1) per stage and ``m >= 2 p``,
    ``p >= 2``, the makespan is ``6 m + p``, one step more than ZB-V's
    ``6 m + p - 1`` (``tests/test_schedules_simulate.py``), with ``2 p + 1``
    stage-microbatches in flight on every rank (ZB-V: ``2 p``).

    Args:
        ranks: Pipeline ranks ``p``.
        microbatches: Microbatches ``m`` (any ``m >= 1``).
        stages_per_rank: Must be 2 (checked by ``build``).

    Returns:
        The schedule.
    """
    actions = [_rank_program(ranks, microbatches, r) for r in range(ranks)]
    return Schedule("dualpipev", ranks, 2 * ranks, microbatches, v_placement(ranks), actions)


def _rank_program(p: int, m: int, r: int) -> list[Action]:
    down, up = r, 2 * p - 1 - r
    row = _Row(m, {0: down, 1: up})
    fill, tail = p - 1 - r, r + 1
    row.run(["F0"] * (2 * fill))
    row.run(["F0", "F1"] * tail)
    row.run(["I1", "W", "F1"] * fill)
    row.run(["F0", "B1", "F1", "B0"] * max(0, m - 2 * p + r + 1))
    row.run(["B1", "F1", "B0"] * fill)
    half = tail // 2
    row.run(["B1", "B0"] * half + ["I1", "I0"] * (tail - half))
    row.run(["W", "I0"] * fill)
    row.run(["W"] * len(row.owed))
    if row.missing():
        raise AssertionError(f"dualpipev program for rank {r} left {row.missing()} unscheduled")
    return row.actions


class _Row:
    """One rank's list being written: per-chunk counters and the W still owed."""

    def __init__(self, m: int, stage: dict[int, int]) -> None:
        self.m, self.stage = m, stage
        self.next = {(kind, c): 0 for kind in (Kind.F, Kind.B) for c in stage}
        self.owed: deque[Action] = deque()
        self.actions: list[Action] = []

    def run(self, slots: list[str]) -> None:
        for slot in slots:
            if slot == "W":
                if self.owed:
                    self.actions.append(self.owed.popleft())
                continue
            kind, chunk = Kind(slot[0]), int(slot[1])
            counter = (Kind.F if kind is Kind.F else Kind.B, chunk)
            j = self.next[counter]
            if j >= self.m:
                continue  # this chunk is done: skip the slot
            self.next[counter] += 1
            self.actions.append(Action(self.stage[chunk], kind, j))
            if kind is Kind.I:
                self.owed.append(Action(self.stage[chunk], Kind.W, j))

    def missing(self) -> dict[tuple[Kind, int], int]:
        return {k: self.m - n for k, n in self.next.items() if n < self.m}
