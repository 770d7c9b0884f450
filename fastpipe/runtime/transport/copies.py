"""Local ranks on GPUs: a send is a copy on the sender's copy lane into the receiver's ring.

Why not ``local``'s blocking device copy: here the sender's compute lane only
records an event and goes on, the copy overlaps compute on both ranks, and
the receive slots are kept across steps, so steady state allocates nothing
(``ReceiveRings``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastpipe.runtime.buffers import BufferRing, Stream
from fastpipe.runtime.packing import Layout, unpack, wire_roundtrip
from fastpipe.runtime.transport.base import Held, Key, SlotReceive
from fastpipe.runtime.transport.local import LocalTransport, Mailbox, mark
from fastpipe.schedules import Action

__all__ = ["CopyTransport", "ReceiveRings"]


class ReceiveRings:
    """The receive slots of a local pipeline whose transfers are copies.

    One growable :class:`BufferRing` per stream (direction, receiving stage),
    on the receiving rank's device, kept by the Pipe across steps so steady
    state allocates nothing. The sender takes a slot when it copies, the
    receiver frees it after the last compute action of that (stage,
    microbatch), fenced by its compute lane. Each ring starts with the most
    slots the schedule can hold at once over every timing (``copy_slots``);
    it may grow, so a sender never blocks on its receiver.
    """

    def __init__(self, sizes: dict[Stream, int], timeout: float) -> None:
        self.sizes, self.timeout = sizes, timeout
        self._rings: dict[Stream, BufferRing] = {}
        self._lock = threading.Lock()

    def ring(self, stream: Stream, device: torch.device) -> BufferRing:
        ring = self._rings.get(stream)
        if ring is None:
            with self._lock:
                ring = self._rings.get(stream)
                if ring is None:
                    ring = BufferRing(self.sizes.get(stream, 1), device, growable=True,
                                      timeout=self.timeout, fenced=True)
                    self._rings[stream] = ring
        return ring

    @property
    def rings(self) -> dict[Stream, BufferRing]:
        return dict(self._rings)


@dataclass
class _CopyRecv(SlotReceive):
    """A transfer copied into a receive slot: waited for on the consumer's compute lane."""

    mailbox: Mailbox
    key: Key
    timeout: float
    lanes: Any  # the consumer's device lanes

    def _take(self) -> tuple[list[torch.Tensor], Any, Held | None]:
        views, spec, done, ring, slot = self.mailbox.take(self.key, self.timeout)
        self._held = (ring, slot)  # held from here, should the wait below fail
        self.lanes.wait(done)  # GPU: the compute stream waits; host: the copy has run
        return views, spec, self._held

    def _hand_back(self, ring: BufferRing, slot: int) -> None:
        """The stage is done with the views: the slot's next writer waits for this point.

        A forward value the stage passed on unchanged (a mask) was sent as a
        view of the slot, read by a copy on this rank's copy lane, which this
        fence does not cover. It need not: in training the slot is handed
        back at the stage's B, which comes after the next stage's F waited
        for that copy; a forward-only pass starts with a slot for every
        microbatch (``copy_slots``), so no slot is reused within it. (The
        input gradients a B sends are tensors autograd made, never views of
        the slot it received.)"""
        ring.put(slot, self.lanes.record())


class CopyTransport(LocalTransport):
    """Local ranks whose transfers are copies on the sender's copy lane.

    A send records the compute lane (the producer's work so far), then, on
    the copy lane, after that event and after the fence of the receive slot's
    last reader, copies every tensor into one slot of the receiver's ring
    (cudaMemcpyPeerAsync between GPUs, memcpy on a host worker). The receiver
    gets views of the slot and an event its compute lane waits on. The
    sources stay referenced until their copy's event is done (instead of
    ``record_stream``, whose reuse point is nondeterministic).

    Used for CUDA devices (:class:`~fastpipe.runtime.lanes.CudaLanes`). On CPU
    devices the plain :class:`LocalTransport` hands tensors over without a
    copy; this class runs there with host lanes only to test the copy path.
    """

    def __init__(self, mailbox: Mailbox, rank: int, devices: Sequence[torch.device], timeout: float,
                 lanes, rings: ReceiveRings, wire: dict | None = None) -> None:
        super().__init__(mailbox, rank, devices, timeout, None, wire)
        self.device_lanes, self.rings = lanes, rings
        self._inflight: deque = deque()  # (copy event, sources kept alive)

    def begin(self, actions: Sequence[Action]) -> None:
        self._inflight.clear()

    def send(self, tensors: list[torch.Tensor], spec: bool, dst: int, key: Key) -> None:
        try:
            lanes, wire = self.device_lanes, self.wire.get(key[0])
            # On the compute lane: the wire rounding and a contiguous source.
            srcs = [wire_roundtrip(t.detach(), wire).contiguous() for t in tensors]
            layout = Layout.plan(srcs)
            ring = self.rings.ring(key[:2], self.devices[dst])
            slot, buf = ring.get(layout.nbytes)
            regions = [(t, s.offset) for t, s in zip(srcs, layout.slots)]
            done = lanes.copy(buf, regions, after=(lanes.record(), ring.fence_of(slot)))
            self._inflight.append((done, srcs))
            while self._inflight and lanes.done(self._inflight[0][0]):
                self._inflight.popleft()  # copied: the sources may go
            views = [mark(v, t) for v, t in zip(unpack(buf, layout), tensors)]
            self.mailbox.put(key, (views, spec, done, ring, slot))
        except BaseException as exc:
            self.mailbox.fail(self.rank, exc)
            raise

    def recv(self, src: int, key: Key) -> _CopyRecv:
        return _CopyRecv(self.mailbox, key, self.timeout, self.device_lanes)

    def finish(self) -> None:
        """Step end: the compute lane waits for the step's copies, then their
        sources go (on a GPU the host does not block: a block those sources
        free is reused only by later work on the compute stream)."""
        inflight, self._inflight = self._inflight, deque()
        for done, _ in inflight:
            self.device_lanes.wait(done)

    def fail(self, exc: BaseException, unsent: Iterable[tuple[Key, int]] = ()) -> None:
        self.mailbox.fail(self.rank, exc)
        for done, _ in self._inflight:
            try:  # a copy may still read its sources: let it end first
                self.device_lanes.synchronize(done)
            except BaseException:  # noqa: BLE001 - the first failure is what gets reported
                pass
        self._inflight.clear()
