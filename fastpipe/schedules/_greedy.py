"""A list scheduler for the zero-bubble family: each backward split into I and W.

Whenever a rank is free it picks its next action by a fixed policy:

1. an I whose gradient has arrived (it is on the critical path back to stage 0);
2. else an F whose input has arrived, unless the rank is at either memory cap:
   ``cap`` microbatches between F and I (the full activations) or
   ``hold_cap`` between F and W (what W still needs is kept too);
3. else the oldest W still owed (weight gradients fill what would be idle);
4. else wait.

Given ``sizes`` (per stage, the bytes a microbatch holds from F to I and
from I to W), the hold cap is in bytes instead: a rank holds no more than
``cap`` times the mean of its stages' F-to-I bytes, the activations of its
F-to-I cap, whichever state its microbatches are in. An F runs only where it
fits; a ready I that would overfill it (what W reads outweighs what the
forward saved, as a vocabulary head's logits gradient) lets the oldest owed
W run first. A W that holds little then lets more microbatches wait for
their W than the count allows, and a heavy one fewer; with every size equal
it is the count cap ``hold_cap = cap``.

Microbatches go through each stage in order. Time is modelled as the
simulator models it: an action takes its cost (F = I = W = 1 unless costs are
given) and a value crossing ranks arrives ``latency`` after it was made. With
unit costs the lists, run again by the simulator, reproduce the step times
the policy saw, because the simulator starts each action as early as the
same dependencies allow. With the stages' real costs (a profile's F, I and
W) the order follows them: where W is much cheaper than F, the unit-cost
order holds a rank's forwards back for W slots that end long before the next
input arrives. A greedy order is no optimum, though: for some costs the unit
order simulates faster, so callers with costs (``fastpipe.plan``) simulate
both and keep the faster.

Should every rank wait with nothing under way, the caps hold back the
forward that would unblock the rest (costs can fill a V rank's cap with its
first stage's forwards); the oldest forward then runs past its cap, and the
simulator, free of the policy's waits, is faster than the policy's clock.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from fastpipe.schedules._costs import Costs, compute_cost
from fastpipe.schedules._ir import Action, Kind, Schedule

__all__ = ["list_schedule", "peak_bytes"]


@dataclass
class _Rank:
    """One rank's state while its list is written."""

    stages: list[int]
    cap: int
    hold_cap: int
    budget: float = float("inf")  # the hold cap in bytes, where ``sizes`` are given
    live: int = 0  # between F and I
    held: int = 0  # between F and W
    nbytes: float = 0.0  # held, by ``sizes``
    owed: deque[Action] = field(default_factory=deque)
    row: list[Action] = field(default_factory=list)
    free: float = 0.0  # when its last action ends


def list_schedule(
    name: str,
    microbatches: int,
    stage_to_rank: Sequence[int],
    caps: Sequence[int],
    hold_caps: Sequence[int],
    costs: Costs | None = None,
    latency: float = 0.0,
    sizes: Sequence[tuple[float, float]] | None = None,
) -> Schedule:
    """Build a schedule with every backward split into I and W, by the policy above.

    Args:
        name: The schedule's name.
        microbatches: Microbatches ``m``.
        stage_to_rank: Placement over ``len(caps)`` ranks.
        caps: Per rank, the most (stage, microbatch) pairs between F and I.
        hold_caps: Per rank, the most between F and W; at least ``caps``.
        costs: Action costs as the simulator takes them
            (:func:`fastpipe.schedules._costs.compute_cost`); ``None`` is
            F = I = W = 1.
        latency: Time from an action's end to its value's arrival on another rank.
        sizes: Per stage, (bytes from F to I, bytes from I to W) of one
            microbatch: the hold cap in bytes (module docstring), in place
            of ``hold_caps``.

    Returns:
        The schedule.

    Raises:
        AssertionError: If the policy gets stuck even past the caps (a bug).
    """
    stages = len(stage_to_rank)
    cost = compute_cost(costs if costs is not None else {"F": 1.0, "I": 1.0, "W": 1.0}, stages)
    ranks = [
        _Rank([s for s in range(stages) if stage_to_rank[s] == r], cap, hold)
        for r, (cap, hold) in enumerate(zip(caps, hold_caps))
    ]
    if sizes is not None:  # the hold cap in bytes: the F-to-I cap's activations
        for rank in ranks:
            rank.budget = rank.cap * sum(sizes[s][0] for s in rank.stages) / len(rank.stages)
    clock = _Clock(stage_to_rank, latency)
    nxt = {(kind, s): 0 for kind in (Kind.F, Kind.I) for s in range(stages)}
    left = 3 * stages * microbatches
    t, capped = 0.0, True
    while left:
        # Until no free rank finds work: an action of zero cost ends at once.
        busy = True
        while busy:
            busy = False
            for rank in ranks:
                if rank.free <= t and (action := _pick(rank, t, stages, microbatches, clock, nxt,
                                                       capped, sizes)):
                    _commit(rank, action, nxt, sizes)
                    rank.free = t + cost(action)
                    clock.ended(action, rank.free)
                    left -= 1
                    busy, capped = True, True
        upcoming = clock.now()
        if upcoming is None and left:
            # Every rank waits and nothing is under way: the caps hold back
            # the forward that would unblock the rest (with several stages a
            # rank, costs can fill its cap with its first stage's forwards).
            # One forward past the cap, then the caps hold again.
            if not capped:
                raise AssertionError(f"list scheduler stuck with {left} actions left")
            capped = False
            continue
        t = upcoming
    rows = [rank.row for rank in ranks]
    return Schedule(name, len(ranks), stages, microbatches, tuple(stage_to_rank), rows)


class _Clock:
    """When each action ended, when its value is usable on a rank, and the
    next moment anything changes."""

    def __init__(self, stage_to_rank: Sequence[int], latency: float) -> None:
        self.owner, self.latency = stage_to_rank, latency
        self.end: dict[tuple[Kind, int, int], float] = {}
        self.events, self.t = [], 0.0

    def ended(self, action: Action, at: float) -> None:
        self.end[(action.kind, action.stage, action.microbatch)] = at
        heapq.heappush(self.events, at)
        if self.latency:
            heapq.heappush(self.events, at + self.latency)

    def now(self) -> float | None:
        """Moves to the next moment after the current one; None when nothing is left to happen."""
        while self.events and self.events[0] <= self.t:
            heapq.heappop(self.events)
        if not self.events:
            return None
        self.t = heapq.heappop(self.events)
        return self.t

    def ready(self, kind: Kind, stage: int, mb: int, on_stage: int, t: float) -> bool:
        """Whether (kind, stage, mb)'s value is usable by ``on_stage`` at ``t``."""
        end = self.end.get((kind, stage, mb))
        if end is None:
            return False
        return end + (self.latency if self.owner[stage] != self.owner[on_stage] else 0.0) <= t


def _pick(
    rank: _Rank,
    t: float,
    stages: int,
    m: int,
    clock: _Clock,
    nxt: dict[tuple[Kind, int], int],
    capped: bool = True,
    sizes: Sequence[tuple[float, float]] | None = None,
) -> Action | None:
    """The policy: ready I (an owed W first where the I would overfill the
    byte cap), else ready F under the caps (or past them where ``capped`` is
    false), else owed W, else None."""
    inputs = [
        Action(s, Kind.I, j)
        for s in rank.stages
        if (j := nxt[(Kind.I, s)]) < m
        and clock.ready(Kind.F, s, j, s, t)
        and (s == stages - 1 or clock.ready(Kind.I, s + 1, j, s, t))
    ]
    if inputs:
        first = min(inputs, key=_earliest)
        if (sizes is not None and rank.owed
                and rank.nbytes - sizes[first.stage][0] + sizes[first.stage][1] > rank.budget):
            return rank.owed[0]
        return first
    if not capped or (rank.live < rank.cap and (sizes is not None or rank.held < rank.hold_cap)):
        forwards = [
            Action(s, Kind.F, j)
            for s in rank.stages
            if (j := nxt[(Kind.F, s)]) < m and (s == 0 or clock.ready(Kind.F, s - 1, j, s, t))
            and (not capped or sizes is None or rank.nbytes + sizes[s][0] <= rank.budget)
        ]
        if forwards:
            return min(forwards, key=_earliest)
    return rank.owed[0] if rank.owed else None


def _earliest(action: Action) -> tuple[int, int]:
    # Oldest microbatch first; on a tie the later stage, which is nearer the
    # turn of the V (or the loss) and so unblocks more work downstream.
    return action.microbatch, -action.stage


def _commit(rank: _Rank, action: Action, nxt: dict[tuple[Kind, int], int],
            sizes: Sequence[tuple[float, float]] | None = None) -> None:
    rank.row.append(action)
    if sizes is not None:
        rank.nbytes += _bytes_added(action, sizes)
    if action.kind is Kind.F:
        nxt[(Kind.F, action.stage)] += 1
        rank.live += 1
        rank.held += 1
    elif action.kind is Kind.I:
        nxt[(Kind.I, action.stage)] += 1
        rank.live -= 1
        rank.owed.append(Action(action.stage, Kind.W, action.microbatch))
    else:
        rank.owed.popleft()
        rank.held -= 1


def _bytes_added(action: Action, sizes: Sequence[tuple[float, float]]) -> float:
    """What ``action`` adds to its rank's bytes: an F its stage's F-to-I
    bytes, an I trades them for its I-to-W bytes, a W frees those."""
    before, after = sizes[action.stage]
    return before if action.kind is Kind.F else after - before if action.kind is Kind.I else -after


def peak_bytes(schedule: Schedule, sizes: Sequence[tuple[float, float]]) -> list[float]:
    """Per rank, the most bytes its list holds at once by the scheduler's
    model of ``sizes`` (``_bytes_added``), whatever the timing."""
    peaks = []
    for row in schedule.actions:
        held = peak = 0.0
        for a in row:
            held += _bytes_added(a, sizes)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
