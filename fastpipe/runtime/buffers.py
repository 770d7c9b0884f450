"""The buffer ring: preallocated P2P buffers per stream, reused, never while in use.

A *stream* is one direction of one stage boundary as seen by one rank:
``("F", s)`` carries activations into stage ``s``, ``("B", s)`` gradients
into stage ``s``. Each stream gets a :class:`BufferRing` of byte buffers.

Receive rings are **bounded**: a receive is posted only once a slot is free,
so memory is ``slots × message size``, not ``microbatches × message size``.
A receive slot is held from its post until the last compute action of its
(stage, microbatch) has run, because the stage input is a view into the
buffer and autograd keeps it for backward (zero copy). ``receive_slots``
sizes each ring from the schedule so that posting ahead never deadlocks.

Send rings are **growable**: the producer never blocks on a send; a slot is
added when none is free yet, and the count settles after the first steps.

The reuse rule lives in the native ``SlotRing``: a slot goes out again only
after the fence its last user released it with (an Event) is done; on the
host lanes, releasing after the operation finished is the fence itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastpipe.schedules import Action, Kind

Stream = tuple[str, int]  # (direction, stage that receives)


def receive_stream(action: Action) -> Stream:
    """The stream a RECV_F / RECV_B action reads from."""
    return ("F" if action.kind is Kind.RECV_F else "B", action.stage)


def last_use(actions: Sequence[Action]) -> dict[tuple[int, int], int]:
    """Index of the last compute action of each (stage, microbatch) in a rank's list."""
    last: dict[tuple[int, int], int] = {}
    for i, a in enumerate(actions):
        if a.kind in (Kind.F, Kind.B, Kind.I, Kind.W):
            last[(a.stage, a.microbatch)] = i
    return last


def receive_slots(actions: Sequence[Action], lookahead: int = 1) -> dict[Stream, int]:
    """Slots per receive stream of one rank's lowered action list.

    A slot is held from its RECV action until the last compute action of the
    same (stage, microbatch). The peak count held at once, walking the list in
    order, is what the rank needs when it posts each receive at its RECV
    action; ``lookahead`` more let receives be posted that many ahead.

    Why this cannot deadlock: a receive posted ahead waits only for slots that
    compute actions *earlier* in the list free, and those need only receives
    earlier in the list, which were posted first.
    """
    last = last_use(actions)
    release_at: dict[int, list[Stream]] = {}
    held: dict[Stream, int] = {}
    peak: dict[Stream, int] = {}
    for i, a in enumerate(actions):
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            stream = receive_stream(a)
            held[stream] = held.get(stream, 0) + 1
            peak[stream] = max(peak.get(stream, 0), held[stream])
            end = last.get((a.stage, a.microbatch), i)
            release_at.setdefault(max(end, i), []).append(stream)
        for stream in release_at.pop(i, ()):
            held[stream] -= 1
    return {stream: n + lookahead for stream, n in peak.items()}


class BufferRing:
    """Byte buffers of one stream on one device, handed out by a native ``SlotRing``.

    Args:
        slots: buffers to start with.
        device: where the buffers live.
        growable: add a slot instead of waiting when none is free (send side).
        timeout: seconds a bounded ring waits for a slot before TimeoutError.
    """

    def __init__(self, slots: int, device: torch.device, growable: bool, timeout: float) -> None:
        from fastpipe._ext import native

        self._slots = native().SlotRing(slots, growable)
        self._buffers: list[torch.Tensor | None] = []
        self.device = device
        self.timeout = timeout
        self.allocations = 0  # buffers created or enlarged: flat in steady state

    def get(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A free slot and a ``uint8`` view of exactly ``nbytes`` of its buffer."""
        slot = self._slots.acquire(self.timeout)
        while len(self._buffers) <= slot:
            self._buffers.append(None)
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[slot] = buf
            self.allocations += 1
        return slot, buf[:nbytes]

    def put(self, slot: int, fence=None) -> None:
        """Frees ``slot``; it is reused only after ``fence`` (an Event or None) is done."""
        self._slots.release(slot, fence)

    def cancel(self, reason: str) -> None:
        """Wakes anyone waiting for a slot with RuntimeError and frees every slot."""
        self._slots.cancel(reason)

    @property
    def size(self) -> int:
        return self._slots.size

    @property
    def held(self) -> int:
        return self._slots.held
