"""The caller's thread-local torch settings on the native ring's lane threads.

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

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
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


# --- autocast ----------------------------------------------------------------------
#
# torch.autocast is thread-local too: a lane thread does not see the caller's
# region, so in local mode a step under ``torch.autocast`` would run in full
# precision. The Pipe reads the caller's state and each rank's executor
# applies it to what the user's code would run inside the region (forwards,
# the loss, recomputation) and keeps it off the backward, as the usual AMP
# loop does (``with autocast: loss = ...`` then ``loss.backward()`` outside;
# torch advises against backward passes under autocast).

_AUTOCAST_DEVICES = ("cpu", "cuda")

Autocast = tuple[tuple[str, torch.dtype], ...]


def autocast_state() -> tuple[Autocast, bool]:
    """The calling thread's enabled autocast regions, as (device type, dtype)
    pairs, and whether autocast's weight-cast cache is on."""
    regions = tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
                    if torch.is_autocast_enabled(d))
    return regions, torch.is_autocast_cache_enabled()


@contextlib.contextmanager
def autocast(regions: Autocast, cache: bool = True, enabled: bool = True) -> Iterator[None]:
    """Enters ``regions`` (``enabled=False``: leaves them off) on this thread."""
    with contextlib.ExitStack() as stack:
        for device, dtype in regions:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,
                                               cache_enabled=cache))
        yield


# Local mode on GPUs: each rank's thread runs Python to launch its stage's
# kernels, holding the GIL most of the time, and torch's launches do not give
# it up. A rank woken by a message may then wait up to the interpreter's
# switch interval (5 ms by default) before it runs. A shorter interval is a
# lead, not a default: on an H200 with two ranks on cuda:0 (bench/gpu_check.py,
# local section, overhead-bound and empty stages, 4 schedules each), 0.2 ms
# took 0.72-1.05x the default's step time in one run and 0.76-1.15x in the
# next (geometric means 0.89 and 0.97): no clear gain for a process-wide
# setting. ``Pipe._switch_interval`` applies one during local steps; the
# device check measures it.
SHORT_SWITCH_INTERVAL = 2e-4


@contextlib.contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """Lowers the GIL's switch interval (``sys.setswitchinterval``) to
    ``seconds`` for the block and restores the previous value after it; a
    no-op for ``None`` or a value no shorter than the current one."""
    previous = sys.getswitchinterval()
    if seconds is None or seconds >= previous:
        yield
        return
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
