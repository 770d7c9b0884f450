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
A device fence (a ``CudaEvent``, recorded on the stream of the slot's last
reader) is not waited for by the host: ``get`` hands it out with the slot
and the next writer's stream waits for it on the GPU, so the slot's memory
is not touched before the event completes and the host never stalls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastpipe.schedules import Action, Kind

__all__ = ["BufferRing", "Stream", "copy_slots", "last_use", "receive_slots", "receive_stream"]

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


def receive_slots(actions: Sequence[Action], lookahead: int | None = None) -> dict[Stream, int]:
    """Slots per receive stream of one rank's lowered action list.

    A slot is held from its RECV action until the last compute action of the
    same (stage, microbatch). The peak count held at once, walking the list in
    order, is what the rank needs when it posts each receive at its RECV
    action; ``lookahead`` more let receives be posted that many ahead.
    ``None`` (the default, what ``DistTransport`` uses): a slot for every
    receive of the stream, so all of a step's receives are posted when it
    starts: on gloo a receive posted late holds up its sender
    (``docs/design/memory.md``, "Receive-ring sizing"). The memory is one
    buffer per microbatch and stream of what crosses the boundary.

    Why this cannot deadlock: a receive posted ahead waits only for slots that
    compute actions *earlier* in the list free, and those need only receives
    earlier in the list, which were posted first.
    """
    last = last_use(actions)
    release_at: dict[int, list[Stream]] = {}
    held: dict[Stream, int] = {}
    peak: dict[Stream, int] = {}
    count: dict[Stream, int] = {}  # receives per stream
    for i, a in enumerate(actions):
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            stream = receive_stream(a)
            count[stream] = count.get(stream, 0) + 1
            held[stream] = held.get(stream, 0) + 1
            peak[stream] = max(peak.get(stream, 0), held[stream])
            end = last.get((a.stage, a.microbatch), i)
            release_at.setdefault(max(end, i), []).append(stream)
        for stream in release_at.pop(i, ()):
            held[stream] -= 1
    if lookahead is None:
        return count
    return {stream: n + lookahead for stream, n in peak.items()}


def copy_slots(actions: Sequence[Sequence[Action]]) -> dict[Stream, int]:
    """Slots per stream when the *sender* takes the slot (local copies).

    In local mode a sender copies into the receiver's ring when its SEND
    action runs, and nothing stops it from running ahead of the receiver, so
    the count depends on timing, unlike ``receive_slots``. This returns its
    worst case over every timing: slots of messages ``j`` still held when
    message ``k`` of the same stream is sent are those whose release is not
    ordered before that send by the schedule's own dependencies (actions of
    a rank run in order; a consumer starts only after its message's send).
    Those orderings are tracked as vector clocks (actions completed on every
    rank before an action starts), over all ranks' lowered lists.
    """
    ranks = len(actions)
    sends: dict[tuple[str, int, int], tuple[int, int]] = {}
    for r, acts in enumerate(actions):
        for i, a in enumerate(acts):
            if a.kind is Kind.SEND_F:
                sends[("F", a.stage + 1, a.microbatch)] = (r, i)
            elif a.kind is Kind.SEND_B:
                sends[("B", a.stage - 1, a.microbatch)] = (r, i)
    needs: dict[tuple[int, int], tuple[str, int, int]] = {}  # (rank, index) -> key it waits for
    taken: set = set()
    for r, acts in enumerate(actions):
        for i, a in enumerate(acts):
            if a.kind is Kind.F:
                key = ("F", a.stage, a.microbatch)
            elif a.kind in (Kind.B, Kind.I):
                key = ("B", a.stage, a.microbatch)
            else:
                continue
            if key in sends and key not in taken:
                taken.add(key)
                needs[(r, i)] = key
    # start[r][i]: actions completed on each rank before action i of rank r starts.
    start: list[list[list[int] | None]] = [[None] * len(acts) for acts in actions]
    pos, done = [0] * ranks, [[0] * ranks for _ in range(ranks)]
    progress = True
    while progress:
        progress = False
        for r in range(ranks):
            while pos[r] < len(actions[r]):
                i = pos[r]
                clock = list(done[r])
                key = needs.get((r, i))
                if key is not None:
                    q, s = sends[key]
                    if start[q][s] is None:
                        break  # its message is not sent yet: another rank first
                    clock = [max(x, y) for x, y in zip(clock, start[q][s])]
                start[r][i] = clock
                done[r] = clock[:r] + [i + 1] + clock[r + 1 :]
                pos[r] += 1
                progress = True
    if any(p < len(acts) for p, acts in zip(pos, actions)):
        raise ValueError("copy_slots: the action lists deadlock (validate the schedule)")
    last = [last_use(acts) for acts in actions]
    holder = {a.stage: r for r, acts in enumerate(actions) for a in acts if a.kind is Kind.F}
    by_stream: dict[Stream, list[tuple[int, int, int, int]]] = {}
    for key, (q, s) in sends.items():
        r = holder[key[1]]
        by_stream.setdefault(key[:2], []).append((s, q, r, last[r][(key[1], key[2])]))
    slots: dict[Stream, int] = {}
    for stream, msgs in by_stream.items():
        msgs.sort()
        peak = 0
        for k, (s_k, q, r, _) in enumerate(msgs):
            seen = start[q][s_k][r]  # receiver's actions finished before this send
            held = 1 + sum(1 for s_j, _, _, rel in msgs[:k] if seen < rel + 1)
            peak = max(peak, held)
        slots[stream] = peak
    return slots


def _allocated_on(device: torch.device):
    """An event after the work so far on the stream a buffer just allocated
    on ``device`` belongs to (this thread's current one there). torch's
    allocator may hand out a block freed on that stream while that stream's
    kernels still read it; a writer on another stream (a copy lane, perhaps
    another GPU's) must wait for this event first."""
    from fastpipe._ext import native

    with torch.cuda.device(device):  # the event, and handle 0 (the default stream), are per device
        event = native().CudaEvent()
        event.record_handle(torch.cuda.current_stream(device).cuda_stream)
    return event


class BufferRing:
    """Byte buffers of one stream on one device, handed out by a native ``SlotRing``.

    Args:
        slots: buffers to start with.
        device: where the buffers live.
        growable: add a slot instead of waiting when none is free (send side).
        timeout: seconds a bounded ring waits for a slot before TimeoutError.
        fenced: writers run on streams of their own (local copy lanes): a
            fresh CUDA buffer's first writer waits for the stream it was
            allocated on (``fence_of``).
    """

    def __init__(self, slots: int, device: torch.device, growable: bool, timeout: float,
                 fenced: bool = False) -> None:
        from fastpipe._ext import native

        self._slots = native().SlotRing(slots, growable)
        self._buffers: list[torch.Tensor | None] = []
        self._device_fences: dict[int, object] = {}  # slot -> CudaEvent its next writer waits on
        self._host_event = native().Event
        self.device = device
        self.timeout, self.fenced = timeout, fenced
        self.allocations = 0  # buffers created or enlarged: flat in steady state

    def get(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A free slot and a ``uint8`` view of exactly ``nbytes`` of its buffer."""
        slot = self._slots.acquire(self.timeout)
        while len(self._buffers) <= slot:
            self._buffers.append(None)
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            fence = self._device_fences.pop(slot, None)
            if fence is not None:
                # The old buffer goes back to torch's allocator, which may hand
                # it out at once: its last reader must be done with it first.
                fence.synchronize()
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[slot] = buf
            self.allocations += 1
            if self.fenced and buf.is_cuda:
                self._device_fences[slot] = _allocated_on(buf.device)
        return slot, buf[:nbytes]

    def put(self, slot: int, fence=None) -> None:
        """Frees ``slot``; it is reused only after ``fence`` is done.

        ``fence``: None (free at once), a ring Event (``get`` waits for it on
        the host) or a device event (handed to the next ``fence_of(slot)``).
        """
        if fence is None or isinstance(fence, self._host_event):
            self._slots.release(slot, fence)
            return
        self._device_fences[slot] = fence  # stored before the slot is free: seen by its next user
        self._slots.release(slot, None)

    def fence_of(self, slot: int):
        """The device event a writer of ``slot`` (just from ``get``) must wait on, or None."""
        return self._device_fences.pop(slot, None)

    def cancel(self, reason: str) -> None:
        """Wakes anyone waiting for a slot with RuntimeError and frees every slot."""
        self._slots.cancel(reason)

    @property
    def size(self) -> int:
        return self._slots.size

    @property
    def held(self) -> int:
        return self._slots.held
