"""Ranks on threads of one process: a send puts fresh tensors into a shared mailbox.

The mailbox's slots and waiting are native, so a receiver waits with the GIL
released and, on a machine with a core to spare, spins instead of sleeping:
waking a sleeping thread (what a Python ``Condition`` does) costs more than
the transfer it waits for, several times per microbatch (figures in
``docs/benchmarks.md``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from fastpipe._ext import native
from fastpipe._microbatch import needs_grad
from fastpipe.runtime.packing import wire_roundtrip
from fastpipe.runtime.threads import with_caller_threads
from fastpipe.runtime.transport.base import (
    CommLanes, Held, Key, Payload, PeerError, SlotReceive, describe,
)
from fastpipe.schedules import Action

__all__ = ["LocalTransport", "Mailbox", "mark"]


class Mailbox:
    """Shared by the ranks of a local pipeline: one slot per key.

    The slots and the waiting are native (``fastpipe._C.Mailbox``): a
    receiver waits with the GIL released, spinning for up to ``spin`` seconds
    before it sleeps. ``spin=None`` spins for 1 ms when the ranks fit on the
    machine's cores and not at all when they do not (a spinning rank would
    then take a core from a computing one).
    """

    def __init__(self, ranks: int = 1, spin: float | None = None) -> None:
        if spin is None:
            spin = 1e-3 if ranks <= (os.cpu_count() or 1) else 0.0
        if spin < 0:
            raise ValueError(f"spin must be >= 0 seconds, got {spin!r}")
        self._native = native().Mailbox(spin)
        self._failed: tuple[int, BaseException] | None = None

    def put(self, key: Key, payload: Payload) -> None:
        self._native.put(_key_id(key), payload)

    def take(self, key: Key, timeout: float) -> Payload:
        status, payload = self._native.take(_key_id(key), timeout)
        if status == 0:
            return payload
        if status == 1:
            rank, exc = self._failed
            raise PeerError(f"pipeline rank {rank} failed: {exc!r}") from exc
        raise TimeoutError(f"no message for {describe(key)} within timeout={timeout} s")

    def fail(self, rank: int, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = (rank, exc)  # set before the native flag wakes anyone
        self._native.fail()

    @property
    def first_failure(self) -> tuple[int, BaseException] | None:
        return self._failed


def _key_id(key: Key) -> int:
    """A key as one integer (the native mailbox's slot index)."""
    direction, stage, mb = key
    return (stage << 33) | (mb << 1) | (direction == "B")


@dataclass
class _MailboxRecv(SlotReceive):
    mailbox: Mailbox
    key: Key
    timeout: float

    def _take(self) -> tuple[list[torch.Tensor], object, Held | None]:
        # Local transfers are fresh tensors: no buffer to hand back.
        tensors, spec = self.mailbox.take(self.key, self.timeout)
        return tensors, spec, None


class LocalTransport:
    """Ranks in one process, each on its own device; a send is a device copy.

    With ``lanes`` the copy runs on this rank's send lane, so the next compute
    action starts at once; without, it runs inline.
    """

    posts_ahead = False  # a receive is a wait on the mailbox, nothing to post

    def __init__(
        self,
        mailbox: Mailbox,
        rank: int,
        devices: Sequence[torch.device],
        timeout: float,
        lanes: CommLanes | None = None,
        wire: dict | None = None,
    ):
        self.mailbox, self.rank, self.devices, self.timeout = mailbox, rank, devices, timeout
        self.lanes = lanes
        self.wire = wire or {}  # direction -> wire dtype: the same rounding as over a network
        self._sends: list = []

    def begin(self, actions: Sequence[Action]) -> None:
        self._sends = []

    def send(self, tensors: list[torch.Tensor], spec: bool, dst: int, key: Key) -> None:
        if self.lanes is None:
            self._deliver(tensors, spec, dst, key)
            return
        job = lambda: self._deliver(tensors, spec, dst, key)  # noqa: E731
        self._sends.append(self.lanes.ring.submit(self.lanes.send, with_caller_threads(job)))

    def _deliver(self, tensors: list[torch.Tensor], spec: bool, dst: int, key: Key) -> None:
        try:
            device, wire = self.devices[dst], self.wire.get(key[0])
            # Blocking copies: the consumer runs on another thread, with no stream sync.
            moved = [mark(wire_roundtrip(t.detach(), wire).to(device), t) for t in tensors]
            self.mailbox.put(key, (moved, spec))
        except BaseException as exc:
            self.mailbox.fail(self.rank, exc)  # the receiver must not wait for it
            raise

    def recv(self, src: int, key: Key) -> _MailboxRecv:
        return _MailboxRecv(self.mailbox, key, self.timeout)

    def finish(self) -> None:
        sends, self._sends = self._sends, []
        for event in sends:
            event.wait(self.timeout)

    def fail(self, exc: BaseException, unsent: Iterable[tuple[Key, int]] = ()) -> None:
        self.mailbox.fail(self.rank, exc)
        self._sends = []


def mark(copy: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Carries over whether the sender's tensor takes part in backward."""
    return copy.requires_grad_(needs_grad(original))
