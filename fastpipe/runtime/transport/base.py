"""The transport contract: the verbs the executor calls to move stage values between ranks.

Every transport takes the same verbs, so the executor has one code path for
ranks on threads of one process (``local``, ``copies``), over
torch.distributed (``dist``) and over shared memory (``fastpipe.runtime.shm``).

``key`` is ``(direction, stage, microbatch)``: ``"F"`` for activations going
to ``stage``, ``"B"`` for gradients going to ``stage``. Keys make matching
independent of the order in which two ranks issue their operations.

With ``lanes`` (a :class:`CommLanes`), communication runs on lanes of the
native ring, so the compute thread never blocks on it:

    compute ──F──► send lane: pack + isend ──► send-done lane: wait, free slot
    post lane: take a slot, irecv ──► recv-done lane: wait, unpack ──► compute

Without lanes every operation runs inline on the compute thread: sends go
out when the schedule says, and receives are posted from a window, in
schedule order, as soon as a buffer slot is free (so a message can land
before its consumer asks for it) and waited for by their consumer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastpipe.runtime.buffers import BufferRing
from fastpipe.schedules import Action

__all__ = [
    "CommLanes", "Held", "Key", "Payload", "PeerError", "PendingReceive", "SlotReceive",
    "Transport", "describe", "timeout_message",
]

Key = tuple[str, int, int]  # (direction, stage, microbatch)
Payload = tuple[list[torch.Tensor], Any]  # (tensors, spec)
Held = tuple[BufferRing, int]  # (ring, slot) a received payload's views point into


@dataclass(frozen=True)
class CommLanes:
    """Lanes of a native ``HostRing`` that one rank's communication runs on."""

    ring: object  # fastpipe._C.HostRing
    send: int
    send_done: int | None = None
    post: int | None = None
    recv_done: int | None = None


class PeerError(RuntimeError):
    """Raised on a rank whose peer failed first; the peer's error is the cause."""


class PendingReceive(Protocol):
    """A receive handed to a transport; its consumer waits for it, then releases it."""

    def wait(self) -> Payload:
        """Blocks until the message is here; returns ``(tensors, spec)``."""
        ...

    def release(self) -> None:
        """The stage no longer needs the tensors: their buffer may be reused."""
        ...

    @property
    def holds_buffer(self) -> bool:
        """After ``wait``: the tensors are views of a buffer ``release`` hands back."""
        ...


class Transport(Protocol):
    """What the executor asks of a rank's transport, one step at a time.

    A step calls ``begin``, then ``send`` and ``recv`` as the schedule says,
    then ``finish``; or ``fail`` when it raises.
    """

    #: True when ``recv`` only queues work, so every receive of a step can be
    #: handed over when the step starts (the executor then does so).
    posts_ahead: bool

    def begin(self, actions: Sequence[Action]) -> None:
        """A step over this rank's action list starts."""
        ...

    def send(self, tensors: list[torch.Tensor], spec: Any, dst: int, key: Key) -> None:
        """Sends without blocking on the receiver; the tensors must not be modified afterwards."""
        ...

    def recv(self, src: int, key: Key) -> PendingReceive:
        """Posts the receive of ``key`` from rank ``src``."""
        ...

    def finish(self) -> None:
        """Waits for the step's outstanding sends."""
        ...

    def fail(self, exc: BaseException, unsent: Iterable[tuple[Key, int]] = ()) -> None:
        """Marks this rank failed, so its peers stop waiting for it.

        Local peers stop at once; a distributed rank sends an abort notice in
        place of every message of the step it has not sent (``unsent``:
        ``[(key, dst)]``), so its peers fail at once with a PeerError naming it.
        """
        ...


class SlotReceive:
    """The shape every pending receive shares: ``wait`` takes the payload and
    notes the buffer slot its views point into; ``release`` hands that slot
    back, once. Subclasses say how a payload is taken and a slot handed back.
    """

    _held: Held | None = None

    def wait(self) -> Payload:
        tensors, spec, self._held = self._take()
        return tensors, spec

    @property
    def holds_buffer(self) -> bool:
        """Its tensors are views of a transport buffer, handed back on ``release``."""
        return self._held is not None

    def release(self) -> None:
        if self._held is not None:
            ring, slot = self._held
            self._held = None
            self._hand_back(ring, slot)

    def _take(self) -> tuple[list[torch.Tensor], Any, Held | None]:
        """Waits for the message: ``(tensors, spec, slot still held or None)``."""
        raise NotImplementedError

    def _hand_back(self, ring: BufferRing, slot: int) -> None:
        ring.put(slot)


def describe(key: Key) -> str:
    """A key in words, for error messages: ``activations of stage 1, microbatch 3``."""
    what = "activations" if key[0] == "F" else "gradients"
    return f"{what} of stage {key[1]}, microbatch {key[2]}"


def timeout_message(what: str, timeout: float, peer: int | None) -> str:
    """The TimeoutError text of a wait for ``what`` (from ``peer``) that ran out."""
    hint = (f"; pipeline rank {peer} may be stuck, slow, or in another call (every rank must "
            "call step() together, or pipe(x) together)") if peer is not None else ""
    return f"{what} not done within timeout={timeout} s{hint} (Pipe(timeout=...) sets the limit)"
