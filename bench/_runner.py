"""Shared benchmark runner: spawn gloo ranks on 127.0.0.1 and time steps by median."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch.multiprocessing as mp


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


def spawn(world: int, target: Callable, *args) -> list:
    """Runs ``target(rank, world, init_method, queue, *args)`` on ``world`` processes.

    Returns what each rank put on the queue, ordered by rank.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=target, args=(r, world, init, queue, *args)) for r in range(world)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return [value for _, value in sorted(results, key=lambda item: item[0])]
