"""What the tests and the benchmarks share beside the models: a loss that
fails on cue, and malloc's bytes in use."""

from __future__ import annotations

import ctypes


class FailsOnce:
    """``loss_fn``, except that its ``at``-th call raises: a step that fails
    with earlier microbatches' backwards done and messages in flight."""

    def __init__(self, loss_fn, at: int) -> None:
        self.loss_fn, self.at, self.calls = loss_fn, at, 0

    def __call__(self, out, target):
        self.calls += 1
        if self.calls == self.at:
            raise ValueError("loss failed once")
        return self.loss_fn(out, target)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


def heap_in_use() -> int | None:
    """Bytes malloc has handed out and not got back (glibc's mallinfo2: arena
    chunks in use plus mmapped chunks). Unlike resident memory it does not move
    when the allocator keeps or returns free pages, so a steady state reads the
    same from step to step and a leak shows as growth. None without glibc 2.33+."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd
