"""Exact contiguous partition of a cost vector: minimise the largest part."""

from __future__ import annotations

from collections.abc import Sequence


def partition(costs: Sequence[float], parts: int, speeds: Sequence[float] | None = None) -> list[int]:
    """Splits ``costs`` into ``parts`` contiguous, non-empty runs.

    Minimises the largest run's time, ``sum(run) / speeds[run index]``, by
    dynamic programming (O(n²·parts)); among optimal splits it returns the one
    whose runs are found first from the left. ``speeds`` (default all 1) lets a
    faster device take a longer run (heterogeneous ranks).

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
    return sizes[::-1]
