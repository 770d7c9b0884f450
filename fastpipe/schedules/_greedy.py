"""A unit-time list scheduler for the zero-bubble family (F, I and W each take one step).

At every step each free rank picks its next action by a fixed policy:

1. an I whose gradient has arrived (it is on the critical path back to stage 0);
2. else an F whose input has arrived, unless the rank is at either memory cap:
   ``cap`` microbatches between F and I (the full activations) or
   ``hold_cap`` between F and W (what W still needs is kept too);
3. else the oldest W still owed (weight gradients fill what would be idle);
4. else wait.

Microbatches go through each stage in order. The lists, run again by the
simulator with unit costs, reproduce the step times exactly, because the
simulator starts each action as early as the same dependencies allow.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from fastpipe.schedules._ir import Action, Kind, Schedule

__all__ = ["list_schedule"]


@dataclass
class _Rank:
    """One rank's state while its list is written."""

    stages: list[int]
    cap: int
    hold_cap: int
    live: int = 0  # between F and I
    held: int = 0  # between F and W
    owed: deque[Action] = field(default_factory=deque)
    row: list[Action] = field(default_factory=list)


def list_schedule(
    name: str,
    microbatches: int,
    stage_to_rank: Sequence[int],
    caps: Sequence[int],
    hold_caps: Sequence[int],
) -> Schedule:
    """Build a schedule with every backward split into I and W, by the policy above.

    Args:
        name: The schedule's name.
        microbatches: Microbatches ``m``.
        stage_to_rank: Placement over ``len(caps)`` ranks.
        caps: Per rank, the most (stage, microbatch) pairs between F and I.
        hold_caps: Per rank, the most between F and W; at least ``caps``.

    Returns:
        The schedule.

    Raises:
        AssertionError: If the policy gets stuck (caps too small for the placement).
    """
    stages = len(stage_to_rank)
    ranks = [
        _Rank([s for s in range(stages) if stage_to_rank[s] == r], cap, hold)
        for r, (cap, hold) in enumerate(zip(caps, hold_caps))
    ]
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, mb) -> step it ends
    nxt = {(kind, s): 0 for kind in (Kind.F, Kind.I) for s in range(stages)}
    total, t = 3 * stages * microbatches, 0
    while sum(len(rank.row) for rank in ranks) < total:
        for rank in ranks:
            action = _pick(rank, t, stages, microbatches, done, nxt)
            if action is not None:
                _commit(rank, action, t, done, nxt)
        t += 1
        if t > 2 * total + stages:
            raise AssertionError(f"list scheduler stuck at step {t} (caps {caps}, {hold_caps})")
    rows = [rank.row for rank in ranks]
    return Schedule(name, len(ranks), stages, microbatches, tuple(stage_to_rank), rows)


def _pick(
    rank: _Rank,
    t: int,
    stages: int,
    m: int,
    done: dict[tuple[Kind, int, int], int],
    nxt: dict[tuple[Kind, int], int],
) -> Action | None:
    """The policy: ready I, else ready F under the caps, else owed W, else None."""

    def ready(kind: Kind, s: int, j: int) -> bool:
        return done.get((kind, s, j), t + 1) <= t

    inputs = [
        Action(s, Kind.I, j)
        for s in rank.stages
        if (j := nxt[(Kind.I, s)]) < m
        and ready(Kind.F, s, j)
        and (s == stages - 1 or ready(Kind.I, s + 1, j))
    ]
    if inputs:
        return min(inputs, key=_earliest)
    if rank.live < rank.cap and rank.held < rank.hold_cap:
        forwards = [
            Action(s, Kind.F, j)
            for s in rank.stages
            if (j := nxt[(Kind.F, s)]) < m and (s == 0 or ready(Kind.F, s - 1, j))
        ]
        if forwards:
            return min(forwards, key=_earliest)
    return rank.owed[0] if rank.owed else None


def _earliest(action: Action) -> tuple[int, int]:
    # Oldest microbatch first; on a tie the later stage, which is nearer the
    # turn of the V (or the loss) and so unblocks more work downstream.
    return action.microbatch, -action.stage


def _commit(
    rank: _Rank,
    action: Action,
    t: int,
    done: dict[tuple[Kind, int, int], int],
    nxt: dict[tuple[Kind, int], int],
) -> None:
    rank.row.append(action)
    done[(action.kind, action.stage, action.microbatch)] = t + 1
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
