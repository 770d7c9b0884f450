"""The caller's thread-local torch settings on the native ring's lane threads.

OpenMP's thread count (``torch.set_num_threads``) and autocast regions are
per thread, and a lane is a thread torch did not start, which would keep
OpenMP's default of one thread per core. Work submitted to a lane is
wrapped by :func:`with_caller_threads`, which applies the submitting
thread's count there first; the caller's autocast regions are read with
:func:`autocast_state` on its thread and entered on the lane with
:func:`autocast`. Why: ``docs/design/architecture.md`` ("Threads, lanes and
the GIL").
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = [
    "Autocast", "SHORT_SWITCH_INTERVAL", "autocast", "autocast_state", "switch_interval",
    "with_caller_threads",
]

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


# Local mode on GPUs: each rank's thread holds the GIL while it launches its
# stage's kernels, so a rank woken by a message may wait up to the
# interpreter's switch interval (5 ms by default) before it runs. A shorter
# interval is a lead, not a default: on one GPU it gave no clear gain
# (docs/benchmarks.md, "Lane threads"). ``FASTPIPE_SWITCH_INTERVAL`` applies
# one during local steps; the device check measures it.
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
