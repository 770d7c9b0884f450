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


def workload_parser(prog: str, doc: str | None, schedules: list[str]):
    """The command line the pipelining benchmarks share: workload, repeats, warm-up, schedules."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--workload", choices=["compute", "overhead", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--schedules", default=",".join(schedules))
    return parser


def workloads(args) -> list[str]:
    return ["compute", "overhead"] if args.workload == "both" else [args.workload]
