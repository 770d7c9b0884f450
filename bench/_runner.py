"""Shared benchmark runner: spawn gloo ranks on 127.0.0.1 and time steps by median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from fastpipe._spawn import spawn  # noqa: F401  (re-exported for the benchmarks)


def median_time(fn: Callable[[], object], warmup: int, repeats: int, sync: Callable[[], None]) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs, after ``warmup`` runs.

    ``sync`` (a barrier across ranks) runs before each timed call so every rank
    starts the step together and the slowest rank decides the time.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
