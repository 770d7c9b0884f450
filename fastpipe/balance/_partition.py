"""Contiguous partition of a cost vector: minimise the busiest rank, then the largest part."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = ["improve", "partition"]

# Above this many candidate splits, ranks with several parts are balanced by
# local search from the per-part optimum instead of by trying every split.
_EXHAUSTIVE = 50_000


def partition(costs: Sequence[float], parts: int, speeds: Sequence[float] | None = None,
              owners: Sequence[int] | None = None) -> list[int]:
    """Splits ``costs`` into ``parts`` contiguous, non-empty runs.

    Minimises the largest run's time, ``sum(run) / speeds[run index]``, by
    dynamic programming (O(n²·parts)); among optimal splits it returns the one
    whose runs are found first from the left. ``speeds`` (default all 1) lets a
    faster device take a longer run (heterogeneous ranks).

    ``owners`` (a schedule's ``stage_to_rank``) says which rank runs each
    part. Where a rank runs several (interleaved and V-shaped schedules) its
    step time is the sum of its parts, and even parts can still leave the
    ranks uneven: a V puts the first and the last stage (embedding, head and
    loss) on one rank. Then the busiest rank's sum is minimised first, the
    largest part second: exactly over every split while there are at most
    50,000 of them, else by moving one cut at a time from the per-part
    optimum while that helps (a local optimum).

    Returns:
        The length of each run (the ``balance``), summing to ``len(costs)``.

    Raises:
        ValueError: ``parts`` < 1, more parts than costs, or bad speeds.
    """
    n = len(costs)
    if parts < 1 or parts > n:
        raise ValueError(f"cannot split {n} layers into {parts} non-empty stages")
    if speeds is None:
        speeds = [1.0] * parts
    speeds = [float(v) for v in speeds]
    if len(speeds) != parts or not all(v > 0 for v in speeds):
        raise ValueError(f"speeds must hold {parts} positive numbers (one per stage), got {speeds!r}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest possible largest run splitting costs[:i] into k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], (prefix[i] - prefix[j]) / speeds[k - 1])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    sizes = sizes[::-1]
    if owners is None:
        return sizes
    owners = list(owners)
    if len(owners) != parts:
        raise ValueError(f"owners must name a rank for each of the {parts} parts, got {owners!r}")
    if len(set(owners)) == parts:  # one part per rank: the ranks are the parts
        return sizes
    return _by_rank(prefix, sizes, speeds, owners)


def _by_rank(prefix: list[float], sizes: list[int], speeds: list[float], owners: list[int]
             ) -> list[int]:
    n, parts = len(prefix) - 1, len(sizes)
    ranks = max(owners) + 1

    def score(cuts: Sequence[int]) -> tuple[float, float]:
        loads = [(prefix[b] - prefix[a]) / v for a, b, v in zip(cuts, cuts[1:], speeds)]
        per_rank = [0.0] * ranks
        for k, load in zip(owners, loads):
            per_rank[k] += load
        return max(per_rank), max(loads)

    if math.comb(n - 1, parts - 1) <= _EXHAUSTIVE:
        best = min(((0, *inner, n) for inner in itertools.combinations(range(1, n), parts - 1)),
                   key=score)
        return [b - a for a, b in zip(best, best[1:])]
    return improve(sizes, lambda sizes: score((0, *itertools.accumulate(sizes))))


def improve(sizes: Sequence[int], score) -> list[int]:
    """Local search over balances: moves one cut by one layer at a time,
    taking the best move, while ``score(sizes)`` (anything ordered, lower is
    better) gets lower. Scores are cached: each balance is scored once."""
    known: dict[tuple[int, ...], object] = {}

    def cached(sizes: tuple[int, ...]):
        if sizes not in known:
            known[sizes] = score(sizes)
        return known[sizes]

    best = tuple(sizes)
    while True:
        moves = [best[:k - 1] + (best[k - 1] + d, best[k] - d) + best[k + 1:]
                 for k in range(1, len(best)) for d in (-1, 1)
                 if best[k - 1] + d >= 1 and best[k] - d >= 1]
        trial = min(moves, key=cached, default=None)
        if trial is None or cached(trial) >= cached(best):
            return list(best)
        best = trial
