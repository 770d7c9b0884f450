"""Torch's intra-op thread count on the native ring's lane threads.

``torch.set_num_threads(n)`` sets OpenMP's thread count for the thread that
calls it (and a process-wide value that ``torch.get_num_threads()`` reads
back). A thread torch did not start, such as a lane of the native ring,
keeps OpenMP's default of one thread per core until it sets its own: every
GEMM and parallel op issued there spreads over all cores, whatever the user
asked for. Measured on a 2-core CPU with ``torch.set_num_threads(1)``: a
512x512 matmul issued on a lane ran on two threads, and a local pipeline's
two ranks then ran four compute threads on two cores (a one-rank pipeline
with fused weight gradients went from 23 to 90 ms per step as soon as a
second Pipe's lanes existed). Work submitted to a lane is therefore wrapped
by :func:`with_caller_threads`, which applies the submitting thread's count
on the lane first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

_applied = threading.local()


def with_caller_threads(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn``, to run on another thread with this thread's intra-op thread count.

    The count is read now, on the submitting thread, and applied on the
    running thread before ``fn`` (once per thread and count: a no-op after).
    """
    n = torch.get_num_threads()

    def task() -> T:
        if getattr(_applied, "n", None) != n:
            torch.set_num_threads(n)
            _applied.n = n
        return fn()

    return task
