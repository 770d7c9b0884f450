"""The process's CUDA streams for device lanes: leased to one owner at a time, never destroyed.

A :class:`~fastpipe.runtime.lanes.CudaLanes` takes its compute and copy streams
from :func:`cuda_streams` and gives them back when it closes; the next lanes
on that device get the same streams again. No stream is destroyed before the
process exits (``fastpipe._C.process_cuda_stream`` makes streams no
destructor destroys): once torch has run work on a stream, autograd nodes and
caching-allocator blocks keep its handle where fastpipe cannot see it, and
destroying it with the Pipe crashed the next Pipe over the same model. Why
leased rather than shared, and why events are not kept:
``docs/design/memory.md``, "The CUDA stream pool".

Example (no GPU needed; the factory makes the streams)::

    >>> pool = StreamPool(lambda device, priority: object())
    >>> a = pool.acquire(0, "compute", 0)
    >>> b = pool.acquire(0, "compute", 0)  # a is leased: a second stream
    >>> a is b
    False
    >>> pool.release(a)
    >>> pool.acquire(0, "compute", 0) is a  # given back, handed out again
    True
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["StreamPool", "cuda_streams"]

Key = tuple[int, str, int]  # (device index, role, priority)


class StreamPool:
    """Streams by (device, role, priority), each leased to one owner at a time and kept forever.

    Args:
        make: ``make(device, priority) -> stream``, called when every stream
            of a key is leased; what it returns is never released or dropped.
    """

    def __init__(self, make: Callable[[int, int], Any]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._streams: dict[Key, list[Any]] = {}  # every stream made, in order
        self._leased: dict[int, Key] = {}  # id(stream) -> its key, while leased

    def acquire(self, device: int, role: str, priority: int) -> Any:
        """The first stream of (device, role, priority) nobody holds; a new one if all are held."""
        key = (device, role, priority)
        with self._lock:
            made = self._streams.setdefault(key, [])
            for stream in made:
                if id(stream) not in self._leased:
                    break
            else:
                stream = self._make(device, priority)
                made.append(stream)
            self._leased[id(stream)] = key
            return stream

    def release(self, stream: Any) -> None:
        """Gives ``stream`` back: the next ``acquire`` of its key may hand it out again.

        Raises:
            ValueError: ``stream`` is not leased from this pool (released twice?).
        """
        with self._lock:
            if self._leased.pop(id(stream), None) is None:
                raise ValueError(f"stream {stream!r} is not leased from this pool (released twice?)")

    def made(self, device: int, role: str, priority: int) -> tuple[Any, ...]:
        """Every stream made for the key so far, leased or not."""
        with self._lock:
            return tuple(self._streams.get((device, role, priority), ()))

    def leased(self) -> int:
        """How many streams are held now."""
        with self._lock:
            return len(self._leased)


@functools.cache
def cuda_streams() -> StreamPool:
    """The process's pool of fastpipe CUDA streams (made on first use, never destroyed)."""
    from fastpipe._ext import native

    return StreamPool(native().process_cuda_stream)
