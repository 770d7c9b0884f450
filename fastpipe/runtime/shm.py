"""Same-host P2P for CPU pipelines: shared-memory rings instead of gloo's sockets.

When every rank of the pipeline runs on one host, a message is one memcpy
into a ring in shared memory that the receiver, waiting with the GIL
released, sees within a cache miss (``csrc/shm_link.h``), instead of a
loopback socket write that wakes two of gloo's threads on the receiving side
(why it matters: ``docs/design/transports.md``, "Same host").

``Pipe(shm=None)`` (the default) takes this path when it can: a gloo group,
CPU devices, every pipeline rank on this host (same host name, boot id and
pid namespace; the rings' pages are reserved when they are made, so a
/dev/shm too small for them falls back to gloo instead of faulting later),
transfers inline (``overlap`` off) and no exact-size messages; otherwise the
messages go through torch.distributed as before. ``shm=False`` (or
``FASTPIPE_SHM=0`` in the environment) always uses torch.distributed;
``shm=True`` requires the shared-memory path and says why it cannot be had.
The process group still does everything else: setting up the rings (three
small collectives when the Pipe is built), the loss broadcast, barriers.

The rings are POSIX shared-memory objects named ``/fastpipe-<token>-<src>-<dst>``,
one per direction between ranks that exchange messages, ``CAPACITY`` bytes
each (``FASTPIPE_SHM_BYTES`` to change it; pages are touched only as far as
messages fill them). Each is created by its
reader and unlinked as soon as both ends have mapped it, so a crash leaves
nothing behind in ``/dev/shm``.

The message format is DistTransport's (``transport.wire``: prefix, head, packed data, the same
wire dtypes); there is no size protocol, since a ring message carries its
length. Failures keep the torch.distributed path's contract: a failing rank
marks its rings aborted with its reason, so a peer waiting on one fails at
once with a PeerError naming it; a peer process that dies is noticed by its
pid within ~20 ms; every wait ends at ``Pipe(timeout=...)``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from fastpipe._ext import native
from fastpipe._microbatch import Spec, needs_grad
from fastpipe.runtime.buffers import BufferRing
from fastpipe.runtime.packing import Layout, pack_into
from fastpipe.runtime.transport.base import (
    Held, Key, PeerError, SlotReceive, describe, timeout_message,
)
from fastpipe.runtime.transport.wire import (
    INFERENCE, check_mode, encode_head, head_block, prefixed, read_head, received, step_mode,
    write_head,
)
from fastpipe.schedules import Action

__all__ = ["CAPACITY", "VALUE_TAG", "ShmTransport", "connect", "neighbours"]

# Ring bytes per direction between two ranks (FASTPIPE_SHM_BYTES overrides).
# A message longer than the free space streams through as its reader takes
# it, so its sender waits for the reader; rings much smaller than the
# last-level cache are faster for small messages. 8 MiB is a compromise
# between the two (figures: docs/benchmarks.md, "Transports").
CAPACITY = 8 << 20


_OK, _ABORTED, _TIMEOUT, _GONE = 0, 1, 2, 3  # ShmLink's statuses
# The tag of a step's mean loss (``send_value``): above every message key's tag.
VALUE_TAG = 1 << 63
log = logging.getLogger(__name__)


def _cpu_contiguous(t: torch.Tensor) -> bool:
    return t.is_cpu and t.is_contiguous()


def _host() -> tuple[str, str, str] | None:
    """(host name, boot id, pid namespace): equal for processes that can share
    rings and see each other's pids (a peer's death is noticed by its pid;
    containers of one pod may share /dev/shm but not their pid namespace);
    None off Linux."""
    if not sys.platform.startswith("linux") or not hasattr(native(), "ShmLink"):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pids = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return socket.gethostname(), boot, pids


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def neighbours(stage_to_rank: Sequence[int], rank: int) -> set[int]:
    """The ranks ``rank`` exchanges messages with: owners of adjacent stages."""
    out = set()
    for s in range(len(stage_to_rank) - 1):
        a, b = stage_to_rank[s], stage_to_rank[s + 1]
        if a != b and rank in (a, b):
            out.add(b if a == rank else a)
    return out


def connect(group: dist.ProcessGroup | None, rank: int, ranks: int, peers: Iterable[int],
            why_not: str | None, required: bool, size: str = ""
            ) -> tuple[object, dict[int, int], dict[int, int]] | None:
    """Sets up this rank's rings to and from ``peers``, collectively over ``group``.

    Args:
        rank, ranks: this rank and the pipeline's size (the group's).
        why_not: a local reason this rank cannot use shared memory, or None.
        required: raise (on every rank) instead of falling back.
        size: ring bytes per direction as ``FASTPIPE_SHM_BYTES`` gives them
            ("": the default); a bad value is refused on every rank.

    Returns:
        (link, writer channel by peer, reader channel by peer), or None when
        the pipeline uses torch.distributed's P2P instead; every rank gets
        the same answer.

    Raises:
        ValueError: ``required`` and some rank cannot take this path.
    """
    peers = sorted(set(peers))
    capacity, bad = _capacity(size, rank)
    mine = {"host": _host(), "why_not": why_not, "token": os.urandom(6).hex(), "bad": bad}
    everyone: list = [None] * ranks
    dist.all_gather_object(everyone, mine, group=group)
    bad = next((info["bad"] for info in everyone if info["bad"]), None)
    if bad is not None:  # raised on every rank, so none is left in a collective
        raise ValueError(bad)
    reason = _refusal(everyone)
    if reason is not None:
        return _without(reason, required)
    token = everyone[0]["token"]
    link = native().ShmLink(1e-3 if ranks <= _cores() else 0.0)  # spin only with a core each
    writers, readers, error = _open_rings(link, lambda src, dst: f"/fastpipe-{token}-{src}-{dst}",
                                          peers, rank, capacity, group, ranks)
    if error is not None:
        link.close()
        return _without(error, required)
    log.info("pipe: messages through shared-memory rings of %d bytes", capacity)
    return link, writers, readers


def _capacity(size: str, rank: int) -> tuple[int, str | None]:
    """Ring bytes (a multiple of 8, at least 64) and what is wrong with ``size``, or None."""
    try:
        capacity = int(size) if size else CAPACITY
    except ValueError:
        return CAPACITY, f"rank {rank}: FASTPIPE_SHM_BYTES must be a number of bytes, got {size!r}"
    return max(64, capacity - capacity % 8), None


def _without(reason: str, required: bool) -> None:
    if required:
        raise ValueError(f"Pipe(shm=True) cannot use shared memory: {reason}")
    log.info("pipe: messages through torch.distributed (no shared memory: %s)", reason)


def _open_rings(link, name, peers: list[int], rank: int, capacity: int, group, ranks: int):
    """(writer channel by peer, reader channel by peer, the first rank's error
    or None), the same error on every rank: 1. every reader makes its rings,
    2. every writer maps them, 3. both ends are mapped (or given up), so the
    names go from /dev/shm."""
    created: list[str] = []
    writers: dict[int, int] = {}
    readers: dict[int, int] = {}
    error = None
    try:
        for src in peers:
            readers[src] = link.open(name(src, rank), True, False, capacity)
            created.append(name(src, rank))
    except (OSError, ValueError) as exc:
        error = f"rank {rank}: {exc}"
    error = _first_error(error, group, ranks)
    if error is None:
        try:
            for dst in peers:
                writers[dst] = link.open(name(rank, dst), False, True, 0)
        except (OSError, ValueError) as exc:
            error = f"rank {rank}: {exc}"
        error = _first_error(error, group, ranks)
    for n in created:
        try:
            native().ShmLink.unlink(n)
        except OSError:
            pass
    return writers, readers, error


def _refusal(everyone: list[dict]) -> str | None:
    for r, info in enumerate(everyone):
        if info["why_not"] is not None:
            return f"rank {r}: {info['why_not']}"
        if info["host"] is None:
            return f"rank {r} is not on Linux with POSIX shared memory"
    hosts = {info["host"][:2] for info in everyone}
    if len(hosts) > 1:
        return "the pipeline's ranks run on more than one host"
    if len({info["host"] for info in everyone}) > 1:
        return "the pipeline's ranks run in different pid namespaces"
    return None


def _first_error(error: str | None, group, ranks: int) -> str | None:
    everyone: list = [None] * ranks
    dist.all_gather_object(everyone, error, group=group)
    return next((e for e in everyone if e is not None), None)


def _key_of(tag: int, stages: int) -> Key:
    """Inverse of ``ShmTransport.tag``."""
    rest = tag >> 1
    return ("B" if tag & 1 else "F", rest % stages, rest // stages)


class _ShmRecv(SlotReceive):
    """A pending receive: ``wait`` takes the message (or one before it) off the ring;
    ``release`` hands its buffer back for reuse once the stage is done with the views."""

    def __init__(self, transport: ShmTransport, src: int, key: Key):
        self.transport, self.src, self.key = transport, src, key

    def _take(self) -> tuple[list[torch.Tensor], Spec, Held | None]:
        return self.transport._take(self.src, self.key)


class ShmTransport:
    """One rank of a same-host CPU pipeline: a message is a memcpy into a shared ring.

    Sends are complete when ``send`` returns (the data is in the ring, or the
    call waited for the reader to make room). A receive takes messages off
    its sender's ring in the sender's order; one that arrives before its
    consumer asks (another order, as zbv's) waits in ``_arrived``.
    """

    posts_ahead = False  # nothing to post: messages land in the ring by themselves

    def __init__(self, link, writers: dict[int, int], readers: dict[int, int], device: torch.device,
                 stages: int, timeout: float, wire: dict | None = None) -> None:
        self.link, self.writers, self.readers = link, writers, readers
        self.device, self.stages, self.timeout = device, stages, timeout
        self.wire = wire or {}
        self._send_buf = torch.empty(0, dtype=torch.uint8)  # packing, when a send needs it
        self._heads: dict = {}  # stream -> (layout, grads, spec, head, head block, data offset)
        # Receive buffers by stream (direction, stage), each made as large as
        # the stream's largest message (microbatches may differ by a row), so
        # a slot fits whatever comes next on it and steady steps allocate none.
        self._rings: dict[tuple[str, int], BufferRing] = {}
        self._largest: dict[tuple[str, int], int] = {}  # stream -> bytes of its largest message
        self._arrived: dict[int, dict[int, tuple]] = {src: {} for src in readers}
        self._mode = 0  # this step's message flag (wire.step_mode)

    def tag(self, key: Key) -> int:
        direction, stage, mb = key
        return (mb * self.stages + stage) * 2 + (direction == "B")

    def _ring(self, tag: int, nbytes: int) -> tuple[BufferRing, int]:
        """The receive ring of the message's stream, and the stream's largest message."""
        stream = ("B" if tag & 1 else "F", (tag >> 1) % self.stages)
        ring = self._rings.get(stream)
        if ring is None:
            ring = self._rings[stream] = BufferRing(1, torch.device("cpu"), growable=True,
                                                    timeout=self.timeout)
        largest = max(nbytes, self._largest.get(stream, 0))
        self._largest[stream] = largest
        return ring, largest

    def begin(self, actions: Sequence[Action]) -> None:
        self._mode = step_mode(actions)
        for arrived in self._arrived.values():
            for _, _, held in arrived.values():
                if held is not None:
                    held[0].put(held[1])
            arrived.clear()

    def send(self, tensors: list[torch.Tensor], spec: Spec, dst: int, key: Key) -> None:
        layout = Layout.plan(tensors, self.wire.get(key[0]))
        grads = tuple(map(needs_grad, tensors))
        # A stream sends the same head every microbatch: encode it once
        # (per call kind: the prefix carries step_mode's flag).
        stream = (*key[:2], self._mode)
        head = self._heads.get(stream)
        # Only plain specs are compared (a structure's plain values could
        # compare as anything); the others are encoded every time.
        if (head is None or head[0] is not layout or head[1] != grads or head[2] is not spec
                or not isinstance(spec, bool)):
            encoded = encode_head(layout, spec, grads)
            head = self._heads[stream] = (layout, grads, spec, encoded,
                                          head_block(encoded, self._mode), prefixed(encoded))
        _, _, _, encoded, block, start = head
        total = start + layout.nbytes
        used, offsets, sizes, plain = layout._regions
        ch, tag = self.writers[dst], self.tag(key)
        if plain and all(map(_cpu_contiguous, tensors)):
            # Straight from the tensors into the ring: no send buffer.
            status = self.link.send_regions(
                ch, tag, total, [0, *(start + o for o in offsets)],
                [block.ctypes.data, *(tensors[i].data_ptr() for i in used)],
                [block.size, *sizes], self.timeout)
        else:  # casts to a wire dtype, or tensors not laid out plainly: pack first
            if self._send_buf.numel() < total:
                self._send_buf = torch.empty(max(total, 2 * self._send_buf.numel()), dtype=torch.uint8)
            buf = self._send_buf[:total]
            write_head(buf, encoded, self._mode)
            pack_into(buf[start:], tensors, layout)
            status = self.link.send(ch, tag, buf.data_ptr(), total, self.timeout)
        if status != _OK:
            raise self._error(status, dst, self.writers[dst],
                              f"room in the ring to rank {dst} for {describe(key)}")

    def recv(self, src: int, key: Key) -> _ShmRecv:
        return _ShmRecv(self, src, key)

    def _take(self, src: int, key: Key):
        """(tensors, spec, slot held or None) of ``key``, from ``src``'s ring."""
        want = self.tag(key)
        arrived = self._arrived[src]
        got = arrived.pop(want, None)
        ch = self.readers[src]
        while got is None:
            status, tag, nbytes = self.link.next(ch, self.timeout)
            if status != _OK:
                raise self._error(status, src, ch, f"{describe(key)} from rank {src}")
            ring, largest = self._ring(tag, nbytes)
            slot, buf = ring.get(largest)  # a slot fits any message of its stream seen so far
            status = self.link.read(ch, buf.data_ptr(), self.timeout)
            if status != _OK:
                ring.put(slot)
                raise self._error(status, src, ch, f"{describe(key)} from rank {src}")
            start, flags, layout, spec, grads = read_head(buf)
            if flags & INFERENCE != self._mode:
                ring.put(slot)
                check_mode(flags, self._mode, src, _key_of(tag, self.stages))
            tensors = received(buf, start, layout, grads)
            held = (ring, slot)
            if all(s.wire is not None for s in layout.slots):  # cast copies: no view left
                ring.put(slot)
                held = None
            if tag == want:
                got = (tensors, spec, held)
            else:
                arrived[tag] = (tensors, spec, held)
        return got

    def send_value(self, value: torch.Tensor, dst: int) -> None:
        """Sends a small contiguous CPU tensor outside the step's messages
        (the step's mean loss, after them): ``take_value`` on ``dst`` reads
        it into a tensor of the same dtype and size."""
        status = self.link.send(self.writers[dst], VALUE_TAG, value.data_ptr(), value.nbytes,
                                self.timeout)
        if status != _OK:
            raise self._error(status, dst, self.writers[dst], f"room in the ring to rank {dst} "
                                                              "for the step's loss")

    def take_value(self, src: int, like: torch.Tensor) -> torch.Tensor:
        """The tensor ``send_value`` sent from ``src``, after every message of
        the step (``like``: its dtype and size)."""
        ch, what = self.readers[src], f"the step's loss from rank {src}"
        status, tag, nbytes = self.link.next(ch, self.timeout)
        if status != _OK:
            raise self._error(status, src, ch, what)
        if tag != VALUE_TAG or nbytes != like.nbytes:
            raise AssertionError(f"rank {src} sent message {_key_of(tag, self.stages)} "
                                 f"({nbytes} bytes) where {what} was due")
        out = torch.empty_like(like)
        status = self.link.read(ch, out.data_ptr(), self.timeout)
        if status != _OK:
            raise self._error(status, src, ch, what)
        return out

    def _error(self, status: int, peer: int, ch: int, what: str) -> BaseException:
        if status == _ABORTED:
            reason = self.link.peer_reason(ch)
            return PeerError(f"pipeline rank {peer} failed: {reason}")
        if status == _GONE:
            return PeerError(f"pipeline rank {peer} is gone (its process died) while waiting "
                             f"for {what}")
        return TimeoutError(timeout_message(what, self.timeout, peer))

    def finish(self) -> None:
        """Sends are done when they return; messages taken ahead must all have been used."""
        left = [(src, tag) for src, arrived in self._arrived.items() for tag in arrived]
        if left:
            raise AssertionError(f"messages nobody took this step: {left}")

    def fail(self, exc: BaseException, unsent=()) -> None:
        """Marks every ring aborted with the reason: peers waiting on one fail at once.

        After a failure the rings hold stale messages: the Pipe refuses further steps.
        """
        reason = str(exc) if isinstance(exc, PeerError) else f"{type(exc).__name__}: {exc}"
        self.link.abort(reason)
        self.begin(())

    def rings(self) -> dict:
        return {"recv": dict(self._rings), "send": {}}
