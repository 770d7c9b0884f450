"""The process's CUDA streams for device lanes: leased to one owner at a time, never destroyed.

A :class:`~fastpipe.runtime.lanes.CudaLanes` takes its compute and copy streams
from :func:`cuda_streams` and gives them back when it closes; the next lanes
on that device get the same streams again. No stream is ever destroyed before
the process exits. The argument:

**A stream torch has seen must outlive everything that may refer to it.**
Once torch has run work on a stream (fastpipe hands its streams to torch as
``torch.cuda.ExternalStream``), torch keeps the bare ``cudaStream_t`` where
fastpipe can neither see nor clear it:

- an autograd node records the stream that was current when it was made, and
  the engine makes that stream current again to run the node's backward. A
  parameter's ``AccumulateGrad`` node is cached on the parameter and lives as
  long as a graph or a hook holds it, which can be longer than the Pipe
  whose stream made it;
- the caching allocator files each block under the stream it was allocated
  on, and when a block used on other streams is freed it records events on
  those streams (``insert_events``), possibly on an autograd engine thread,
  long after the step;
- at the end of a backward the engine makes the caller's stream wait on the
  leaf streams it ran on.

A Pipe cannot tell when the last of those is gone, so a stream it lent to
torch has to live as long as the process. Destroying the streams with the
Pipe left dangling handles behind: a second Pipe over the same model on one
GPU crashed (SIGSEGV), or the allocator failed with "CUDA error: context is
destroyed" inside ``insert_events``.

**Reused, not made per Pipe and leaked.** A program that builds Pipes in a
loop (a sweep, a test suite, a rebuild after a failed step) would otherwise
make streams without bound. Leasing bounds them by the most lanes alive at
once. Reuse also keeps the allocator's cache useful: blocks cached under a
stream serve only that stream, so the next Pipe on the same stream reuses
them instead of growing the reserved memory.

**One owner at a time, not one stream per (device, role) for everyone.**
Two ranks on one GPU need two compute streams to overlap, and two Pipes alive
at once would otherwise queue behind each other. Sharing would still be
correct (a stream only adds order, and ``cudaStreamWaitEvent`` refers to
work already queued, so no cycle can form), only slower.

**A stream handed on with work still queued is safe.** The previous owner's
kernels and copies run first (a stream is FIFO): the new owner's work is
ordered after more, never less.

**Kept in C++, not by Python references.** ``fastpipe._C.process_cuda_stream``
makes streams that no destructor ever destroys. At interpreter exit Python
clears modules in an order of its own; a stream destroyed then could still be
named by parameters the allocator frees (and records events for) afterwards.

**Events are not kept.** fastpipe's ``CudaEvent`` objects are never handed to
torch (torch records events of its own), so fastpipe may destroy them when it
drops them; CUDA releases an event that is still pending or waited on only
once the device is done with it.

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
