"""A rank's device lanes: where its compute and its copies run, and how they are ordered.

One abstraction, two backends, the same verbs:

    compute()          context: this thread's work now goes to the compute lane
    record()           an event after the compute lane's work so far
    wait(event)        the compute lane's later work waits for ``event``
    copy(dst, regions, after) -> event
                       on the copy lane, after every event in ``after``: copy
                       each (src tensor, offset) into ``dst`` (a byte buffer)
    done(event)        has it completed? (never blocks)
    synchronize(event) block the host until it has

A transfer between two ranks of one process then reads

    producer compute ──record()──► copy lane: wait, copy into a receive slot
        ──event──► consumer: wait(event), compute on views of the slot
        ──record()──► the slot's fence: the next copy into it waits for it

**CUDA** (:class:`CudaLanes`): the compute and copy lanes are CUDA streams the
native ring creates (``fastpipe._C.CudaStream``, non-blocking; not torch's
pooled streams, which hand the same stream to unrelated users), given to
torch as ``torch.cuda.ExternalStream`` so the stage's kernels run on them.
They are leased from the process's pool (``runtime/streams.py``) and given
back by ``close()``, never destroyed: torch keeps their handles in autograd
nodes and allocator blocks that may outlive the Pipe.
The copy lane has the higher priority, so a transfer is not queued behind a
long kernel. Events are ``fastpipe._C.CudaEvent`` (cudaEventRecord,
cudaStreamWaitEvent); copies are cudaMemcpyPeerAsync. Nothing here blocks the
host: ordering is the GPU's job. No ``record_stream``: a copy's sources are
kept alive by the caller until its event is done, and a slot's next writer
waits on the fence of its last reader.

**Host** (:class:`HostLanes`): compute is finished when the thread has run it,
so ``record()`` is ``None`` (nothing to wait for) and ``compute()`` changes
nothing; copies run on a worker thread of the native ``HostRing`` (memcpy
with the GIL released) and their events are that ring's Events. It is what a
CPU rank uses, and it runs the very transport code the CUDA lanes run, which
is how the copy path is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence

import torch

from fastpipe._ext import native
from fastpipe.runtime.streams import cuda_streams

__all__ = ["CudaLanes", "HostLanes", "lanes_for"]

Regions = Sequence[tuple[torch.Tensor, int]]  # (contiguous source, byte offset in dst)


class HostLanes:
    """Host backend: compute on the calling thread, copies on lane ``copy_lane`` of ``ring``.

    Args:
        ring: a ``fastpipe._C.HostRing``.
        copy_lane: the lane index copies run on (FIFO: copies finish in order).
        timeout: seconds ``wait`` blocks for a copy before TimeoutError.
    """

    def __init__(self, ring, copy_lane: int, timeout: float) -> None:
        self.ring, self.copy_lane, self.timeout = ring, copy_lane, timeout
        self._copy = native()._copy_regions

    def compute(self):
        return contextlib.nullcontext()

    def record(self):
        return None  # host compute is done once it has run: nothing to wait for

    def wait(self, event) -> None:
        if event is not None:
            event.wait(self.timeout)  # re-raises a failed copy's exception

    def copy(self, dst: torch.Tensor, regions: Regions, after=()):
        base, copy = dst.data_ptr(), self._copy
        srcs, offsets, sizes = _spans(regions)
        deps = [e for e in after if e is not None]
        return self.ring.submit(self.copy_lane, lambda: copy(base, srcs, offsets, sizes), deps)

    @staticmethod
    def done(event) -> bool:
        return event is None or event.done()

    def synchronize(self, event) -> None:
        self.wait(event)

    def enter_from_caller(self) -> None:
        """Step start: the compute lane follows the caller's work (host: already done)."""

    def exit_to_caller(self) -> None:
        """Step end: the caller's later work follows the compute lane (host: already done)."""

    def close(self) -> None:
        """Nothing to give back: the ring is the Pipe's."""


_PEERS: set[tuple[int, int]] = set()  # (source, destination) GPUs with peer access asked for


def _enable_peer_access(src: int, dst: int) -> None:
    """Peer access between two GPUs, as torch enables it: without it
    cudaMemcpyPeerAsync is staged through the host. A one-element copy
    between the two makes torch call cudaDeviceEnablePeerAccess (once per
    pair, where the devices allow it)."""
    _PEERS.add((src, dst))
    torch.empty(1, device=f"cuda:{dst}").copy_(torch.empty(1, device=f"cuda:{src}"))


class CudaLanes:
    """CUDA backend: a compute stream and a copy stream on ``device``, leased by fastpipe.

    The streams come from the process's pool (:func:`~fastpipe.runtime.streams.cuda_streams`)
    and go back to it on ``close()`` or when the lanes are collected; they are
    never destroyed (``runtime/streams.py`` says why).

    Args:
        device: a CUDA device.
        compute_priority / copy_priority: CUDA stream priorities (lower is
            higher); by default the copy lane gets the device's highest.
        single_stream: copies run on the compute stream (no overlap): the
            sequential baseline the lanes are measured against.
    """

    def __init__(self, device: torch.device, compute_priority: int = 0,
                 copy_priority: int | None = None, single_stream: bool = False) -> None:
        C = native()
        if not getattr(C, "has_cuda", False):
            raise RuntimeError(f"{device} needs fastpipe's CUDA backend: {C.cuda_status()}")
        if not C.cuda_runtime_available():
            raise RuntimeError(f"{device}: {C.cuda_status()}")
        self._C = C
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        if copy_priority is None:
            copy_priority = C.cuda_priority_range(self.index)[1]
        pool = cuda_streams()
        with torch.cuda.device(self.index):
            self.compute_stream = pool.acquire(self.index, "compute", compute_priority)
            try:  # no copy lane with single_stream: copies queue behind compute ("ring off")
                self.copy_stream = (self.compute_stream if single_stream
                                    else pool.acquire(self.index, "copy", copy_priority))
            except BaseException:
                pool.release(self.compute_stream)
                raise
        leased = list(dict.fromkeys([self.compute_stream, self.copy_stream]))
        self._release = weakref.finalize(self, _give_back, pool, leased)
        # torch launches on them through these views; the streams stay ours.
        self._torch_compute = torch.cuda.ExternalStream(self.compute_stream.handle, device=self.device)

    def compute(self):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.index))
        stack.enter_context(torch.cuda.stream(self._torch_compute))
        return stack

    def _event(self):
        with torch.cuda.device(self.index):  # an event belongs to the device it was made on
            return self._C.CudaEvent()

    def record(self):
        event = self._event()
        event.record(self.compute_stream)
        return event

    def wait(self, event) -> None:
        if event is not None:
            event.wait(self.compute_stream)

    def copy(self, dst: torch.Tensor, regions: Regions, after=()):
        for event in after:
            if event is not None:
                event.wait(self.copy_stream)
        srcs, offsets, sizes = _spans(regions)
        dst_index = dst.device.index if dst.device.type == "cuda" else -1
        if dst_index < 0:
            raise ValueError(f"CudaLanes.copy needs a CUDA destination, got {dst.device}")
        if dst_index != self.index and (self.index, dst_index) not in _PEERS:
            _enable_peer_access(self.index, dst_index)
        self._C.copy_regions_async(dst.data_ptr(), dst_index, srcs, self.index, offsets, sizes,
                                   self.copy_stream)
        event = self._event()
        event.record(self.copy_stream)
        return event

    @staticmethod
    def done(event) -> bool:
        return event is None or event.query()

    @staticmethod
    def synchronize(event) -> None:
        if event is not None:
            event.synchronize()

    def enter_from_caller(self) -> None:
        """Step start, on the caller's thread: the compute lane waits for the
        caller's current stream, which may still be producing the inputs."""
        # Handle 0 (the default stream) means the *current* device's: be on ours.
        with torch.cuda.device(self.index):
            event = self._event()
            event.record_handle(torch.cuda.current_stream(self.device).cuda_stream)
        event.wait(self.compute_stream)

    def exit_to_caller(self) -> None:
        """Step end, on the caller's thread: its current stream waits for the
        compute lane, so the loss and ``.grad`` read there are complete (as
        after a plain ``backward()``; the host does not block)."""
        event = self.record()
        with torch.cuda.device(self.index):  # as above: handle 0 is per device
            event.wait_handle(torch.cuda.current_stream(self.device).cuda_stream)

    def close(self) -> None:
        """Gives the streams back to the pool (once; also done when the lanes
        are collected). Work still queued on them runs first: the next owner's
        work queues behind it. These lanes must not be used afterwards."""
        self._release()


def _give_back(pool, streams) -> None:
    for stream in streams:
        pool.release(stream)


def _spans(regions: Regions) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, offsets in the destination, byte sizes) of ``regions``."""
    return ([t.data_ptr() for t, _ in regions], [off for _, off in regions],
            [t.numel() * t.element_size() for t, _ in regions])


def lanes_for(device: torch.device, ring, copy_lane: int, timeout: float, overlap: bool = True):
    """The backend a rank on ``device`` uses: CUDA streams on a GPU, host lanes otherwise."""
    if device.type == "cuda":
        return CudaLanes(device, single_stream=not overlap)
    return HostLanes(ring, copy_lane, timeout)
