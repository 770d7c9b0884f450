"""Spawning local gloo ranks for the demo and the benchmarks (not for users' jobs)."""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
from collections.abc import Callable

import torch.multiprocessing as mp

__all__ = ["spawn"]


def spawn(world: int, target: Callable, *args, timeout: float = 1800.0) -> list:
    """Runs ``target(rank, world, init_method, queue, *args)`` in ``world`` processes.

    Each rank puts ``(rank, value)`` on the queue. A rank that dies without
    reporting ends the wait at once with a RuntimeError naming it, instead of
    leaving the caller blocked until ``timeout``.

    Returns:
        The values, ordered by rank.
    """
    ctx = mp.get_context("spawn")
    results: dict[int, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        q = ctx.Queue()
        procs = [ctx.Process(target=target, args=(r, world, init, q, *args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world:
                try:
                    rank, value = q.get(timeout=1.0)
                    results[rank] = value
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(
                            f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                            "before reporting (its traceback is above)"
                        ) from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"ranks did not finish within timeout={timeout} s") from None
        finally:
            for p in procs:
                p.join(10 if len(results) == world else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [results[r] for r in range(world)]
