"""Moving stage values between pipeline ranks: in one process, or over torch.distributed.

Both transports take the same verbs, so the executor has one code path:

    begin(actions)                      a step over this rank's action list starts
    send(tensors, spec, dst, key)   non-blocking; the tensors must not be
                                        modified afterwards
    recv(src, key) -> Pending           posts the receive; Pending.wait()
                                        returns (tensors, spec) and
                                        Pending.release() hands its buffer back
                                        once the stage no longer needs it
    finish()                            waits for outstanding sends
    fail(exc, unsent)                   marks this rank failed: local peers stop
                                        waiting at once; a distributed rank sends
                                        an abort notice in place of every message
                                        of the step it has not sent (``unsent``:
                                        [(key, dst)]), so its peers fail at once
                                        with a PeerError naming it
    posts_ahead                         True when recv() only queues work on a
                                        lane, so every receive of a step can be
                                        handed over when it starts

With ``lanes`` (a :class:`CommLanes`), communication runs on lanes of the
native ring, so the compute thread never blocks on it:

    compute ──F──► send lane: pack + isend ──► send-done lane: wait, free slot
    post lane: take a slot, irecv ──► recv-done lane: wait, unpack ──► compute

Without lanes every operation runs inline on the compute thread: sends go
out when the schedule says, and receives are posted from a window, in
schedule order, as soon as a buffer slot is free (so a message can land
before its consumer asks for it) and waited for by their consumer.

``key`` is ``(direction, stage, microbatch)``: ``"F"`` for activations going
to ``stage``, ``"B"`` for gradients going to ``stage``. Keys make matching
independent of the order in which two ranks issue their operations.
"""

from __future__ import annotations

import pickle
import struct
from collections import deque
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from fastpipe._ext import native
from fastpipe._microbatch import Spec, needs_grad
from fastpipe.runtime.buffers import BufferRing, Stream, receive_slots
from fastpipe.runtime.packing import Layout, aligned, pack_into, unpack, wire_roundtrip
from fastpipe.runtime.threads import with_caller_threads
from fastpipe.schedules import Action, Kind

Key = tuple[str, int, int]
Payload = tuple[list[torch.Tensor], Any]  # (tensors, spec)


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


class Mailbox:
    """Shared by the ranks of a local pipeline: one slot per key.

    The slots and the waiting are native (``fastpipe._C.Mailbox``): a
    receiver waits with the GIL released, spinning for up to ``spin`` seconds
    before it sleeps, since waking a sleeping thread (what a Python
    ``Condition`` does) took 88–146 µs per message on the benchmark machine,
    several times per microbatch. ``spin=None`` spins for 1 ms when the
    ranks fit on the machine's cores and not at all when they do not (a
    spinning rank would then take a core from a computing one).
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
        raise TimeoutError(f"no message for {_describe(key)} within timeout={timeout} s")

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


def _describe(key: Key) -> str:
    what = "activations" if key[0] == "F" else "gradients"
    return f"{what} of stage {key[1]}, microbatch {key[2]}"


@dataclass
class _MailboxRecv:
    mailbox: Mailbox
    key: Key
    timeout: float

    def wait(self) -> Payload:
        return self.mailbox.take(self.key, self.timeout)

    def release(self) -> None:
        """Local transfers are fresh tensors: no buffer to hand back."""


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
            moved = [_mark(wire_roundtrip(t.detach(), wire).to(device), t) for t in tensors]
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

    def fail(self, exc: BaseException, unsent=()) -> None:
        self.mailbox.fail(self.rank, exc)
        self._sends = []


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
                                      timeout=self.timeout)
                    self._rings[stream] = ring
        return ring

    @property
    def rings(self) -> dict[Stream, BufferRing]:
        return dict(self._rings)


@dataclass
class _CopyRecv:
    """A transfer copied into a receive slot: waited for on the consumer's compute lane."""

    mailbox: Mailbox
    key: Key
    timeout: float
    lanes: Any  # the consumer's device lanes
    _slot: tuple | None = None

    def wait(self) -> Payload:
        views, spec, done, ring, slot = self.mailbox.take(self.key, self.timeout)
        self._slot = (ring, slot)
        self.lanes.wait(done)  # GPU: the compute stream waits; host: the copy has run
        return views, spec

    def release(self) -> None:
        """The stage is done with the views: the slot's next writer waits for this point."""
        if self._slot is not None:
            ring, slot = self._slot
            self._slot = None
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
            views = [_mark(v, t) for v, t in zip(unpack(buf, layout), tensors)]
            self.mailbox.put(key, (views, spec, done, ring, slot))
        except BaseException as exc:
            self.mailbox.fail(self.rank, exc)
            raise

    def recv(self, src: int, key: Key) -> _CopyRecv:
        return _CopyRecv(self.mailbox, key, self.timeout, self.device_lanes)

    def finish(self) -> None:
        inflight, self._inflight = self._inflight, deque()
        for done, _ in inflight:
            self.device_lanes.synchronize(done)

    def fail(self, exc: BaseException, unsent=()) -> None:
        self.mailbox.fail(self.rank, exc)
        for done, _ in self._inflight:
            try:  # a copy may still read its sources: let it end first
                self.device_lanes.synchronize(done)
            except BaseException:  # noqa: BLE001 - the first failure is what gets reported
                pass
        self._inflight.clear()


def _mark(copy: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Carries over whether the sender's tensor takes part in backward."""
    return copy.requires_grad_(needs_grad(original))


# --- torch.distributed -------------------------------------------------------
#
# One message per transfer: a 16-byte prefix, a head that says what the data
# is (value structure, gradient flags, the packing Layout), then the data as
# ``fastpipe.pack`` lays it out (16-byte aligned slots, optional wire dtype):
#
#   [ head bytes | flags ][ spec kind, grads, Layout, pickled spec ][ data ... ]
#   '--- 16 bytes -------''------- head (padded to 16) -------------'
#
# The receiver posts its buffer before the data exists, so it must guess the
# size: each stream (direction, stage) has a capacity that both ends derive
# from the same history (the largest message of earlier steps), so they agree
# without talking. gloo accepts a message shorter than the posted buffer. A
# message over capacity goes as a 16-byte notice [total bytes | OVERSIZE] on
# the posted tag, followed by the full message on the next tag. A rank that
# fails sends [length | ABORT][reason] on the tag of every message it still
# owed, so whoever waits for one learns who failed and why, at once.
#
# NCCL needs every receive to be exactly the size of its send, and matches a
# pair's messages by order (it ignores tags). With ``exact``:
# - every message on a posted tag (data, notice or abort) is padded to the
#   size the receiver posted, max(capacity, _MIN_POST), which both ends know;
# - every tag is 0, and the receiver posts and completes each peer's
#   messages in the order that peer sends them (``sender_orders``; in some V
#   schedules it differs from the receiver's own RECV order), keeping those
#   its consumers do not need yet;
# - the full message after an oversize notice goes on groups of their own
#   (``late_groups``), in the same order, exactly the announced total;
# - as on gloo, messages up and down the ranks travel on two groups
#   (``flow_groups``): ProcessGroupNCCL runs a pair's sends and receives on
#   one stream, in the order they are issued, so a receive posted ahead would
#   hold up every send issued after it to the same peer (and the peer waits
#   for that send to produce what the receive expects). With one group per
#   way, a pair's stream carries one way only.
# The buffers then live on the GPU (``buffers``) and the receiver copies the
# first bytes (prefix and head) to the host to read them. Lanes mode is not
# used (NCCL's own streams overlap the transfers).

# gloo's TCP transport handles each pair of ranks on one socket, guarded by
# one lock that the caller of isend/irecv holds while it writes, and an event
# loop thread that only try-locks it: when the loop finds the lock taken it
# returns and polls again, spinning. On a busy host the writer is often
# preempted inside that write by the loop thread it just woke, which then
# spins until the scheduler takes it off: milliseconds per message. So data
# going up the ranks (to a higher rank) and data coming down travel on two
# process groups, each with its own sockets, locks and loop thread: one
# pair's socket then carries data one way only (1F1B's activations and
# gradients, a V schedule's way out and way back), and the two flows stop
# stalling each other.
_FLOW_GROUPS: dict = {}  # parent group -> {"up": group, "down": group}


def flow_groups(group: dist.ProcessGroup | None) -> dict[str, dist.ProcessGroup]:
    """Two process groups over ``group``'s ranks, on its backend: "up" carries
    messages to a higher rank, "down" to a lower one (gloo: see above; NCCL:
    see the comment on exact messages).

    Collective over the ranks of ``group`` (only they take part), so every
    rank must call it in the same order, as it builds its Pipe. The groups
    are made once per parent group and shared by every Pipe over it (steps
    of two Pipes never run at once in one process); they live until
    ``destroy_process_group()``, after which the next call forgets them.
    """
    parent = group if group is not None else dist.group.WORLD
    return _groups_over(_FLOW_GROUPS, group, ("up", "down"), dist.get_backend(parent))


_LATE_GROUPS: dict = {}  # parent group -> {"up": group, "down": group}


def late_groups(group: dist.ProcessGroup | None) -> dict[str, dist.ProcessGroup]:
    """Two more groups over ``group``'s ranks (same backend, "up" and "down"
    as in ``flow_groups``) for the full message that follows an oversize
    notice when messages are exact.

    NCCL matches a pair's messages by order, not by tag, and the receiver has
    usually posted the next receives already: a follow-up sent on the same
    group would land in one of them. On groups of their own the follow-ups
    keep their own order, which both ends walk in the sender's order.
    Collective and cached like ``flow_groups``.
    """
    parent = group if group is not None else dist.group.WORLD
    return _groups_over(_LATE_GROUPS, group, ("up", "down"), dist.get_backend(parent))


def connect_pairs(groups: Sequence[dist.ProcessGroup], parent: dist.ProcessGroup | None,
                  stage_to_rank: Sequence[int], rank: int, device: torch.device) -> None:
    """One blocking exchange per pair of neighbouring ranks on each group, in
    one order every rank follows: pairs by (lower, higher) rank, the lower
    one sending.

    Why: ProcessGroupNCCL makes a pair's communicator at the pair's first
    P2P call on a group, and that blocks until the peer makes it too. A step
    posts its receives first, and two neighbours' first calls are on
    different groups (rank 0 receives gradients on "down" while rank 1
    receives activations on "up"): each would wait for the other. Made here
    in a total order, the pair that comes first always has both ranks at
    it, so every pair gets connected. Collective over the pipeline's ranks.
    """
    pairs = sorted({(min(a, b), max(a, b)) for a, b in zip(stage_to_rank, stage_to_rank[1:])
                    if a != b and rank in (a, b)})
    token = torch.zeros(1, device=device)
    for group in groups:
        for low, high in pairs:
            if rank == low:
                peer = dist.get_global_rank(parent, high) if parent is not None else high
                dist.send(token, dst=peer, group=group)
            else:
                peer = dist.get_global_rank(parent, low) if parent is not None else low
                dist.recv(token, src=peer, group=group)


def _groups_over(cache: dict, group, names: tuple[str, ...], backend: str) -> dict:
    parent = group if group is not None else dist.group.WORLD
    for stale in [p for p in cache if not _alive(p)]:
        del cache[stale]  # destroyed with its world: drop it and its groups
    found = cache.get(parent)
    if found is None:
        ranks = dist.get_process_group_ranks(parent)
        found = {name: dist.new_group(ranks, backend=backend, use_local_synchronization=True)
                 for name in names}
        cache[parent] = found  # holds ``parent``: its key is never reused
    return found


def _alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered (not destroyed)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


_PREFIX = 16
_PREFIX_WORDS = struct.Struct("=qq")  # data offset, flags
_OVERSIZE = 1
_ABORT = 2  # the sender failed: the rest of the message is its reason (utf-8)
# Sent from pipe(x) (inference), not step(): the keys are the same, so a
# rank that receives a message of the other kind knows its peer is in
# another call and fails the step at once instead of waiting out the timeout.
_INFERENCE = 4


def step_mode(actions: Sequence[Action]) -> int:
    """The flag a rank's messages carry for this action list: ``_INFERENCE``
    unless it has backward actions (every rank's training list has)."""
    backward = (Kind.B, Kind.I, Kind.W)
    return 0 if any(a.kind in backward for a in actions) else _INFERENCE


class CallMismatch(RuntimeError):
    """A peer is in another call (``step`` here, ``pipe(x)`` there, or the reverse)."""


def check_mode(flags: int, mode: int, src: int, key) -> None:
    """Raises CallMismatch when a message was sent from the other call than this rank's."""
    if flags & _INFERENCE != mode:
        theirs, ours = ("pipe(x)", "step()") if flags & _INFERENCE else ("step()", "pipe(x)")
        raise CallMismatch(
            f"pipeline rank {src} runs {theirs} while this rank runs {ours} ({_describe(key)} "
            "came from it): every rank must make the same call, step() together or pipe(x) "
            "together")
_MIN_POST = 256  # bytes of a receive buffer before any size is known (>= any notice)
_HEAD = struct.Struct("<BHI")  # spec kind, tensors, pickled-spec bytes


def encode_head(layout: Layout, spec: Spec, grads: Sequence[bool]) -> bytes:
    """What a receiver needs to read a packed message (see the comment above)."""
    kind = 0 if spec is False else 1 if spec is True else 2
    extra = pickle.dumps(spec) if kind == 2 else b""
    return _HEAD.pack(kind, len(grads), len(extra)) + bytes(grads) + layout.to_bytes() + extra


def decode_head(data: bytes) -> tuple[Layout, Spec, list[bool]]:
    """Inverse of ``encode_head``."""
    kind, n, extra = _HEAD.unpack_from(data, 0)
    pos = _HEAD.size
    grads = [bool(b) for b in data[pos : pos + n]]
    layout, used = Layout.from_bytes(memoryview(data)[pos + n :])
    pos += n + used
    spec = (False, True)[kind] if kind < 2 else pickle.loads(data[pos : pos + extra])
    return layout, spec, grads


def _prefixed(head: bytes) -> int:
    """Bytes of prefix + head, padded so the data starts 16-byte aligned."""
    return aligned(_PREFIX + len(head))


_HEADS_MAX = 1024  # entries of each head cache below (a boundary has one or a few heads)
_WRITTEN: dict[tuple[bytes, int], np.ndarray] = {}  # (head, flags) -> prefix + head bytes


_WRITTEN_ON: dict[tuple[bytes, int, torch.device], torch.Tensor] = {}  # the same, on a GPU


def head_block(head: bytes, flags: int = 0) -> np.ndarray:
    """The prefix (data offset, flags) and the head as one block of bytes,
    made once per head (a boundary sends the same head every microbatch)."""
    block = _WRITTEN.get((head, flags))
    if block is None:
        block = np.frombuffer(_PREFIX_WORDS.pack(_prefixed(head), flags) + head, dtype=np.uint8)
        if len(_WRITTEN) >= _HEADS_MAX:
            _WRITTEN.clear()
            _WRITTEN_ON.clear()
        _WRITTEN[(head, flags)] = block
    return block


def write_head(buf: torch.Tensor, head: bytes, flags: int = 0) -> None:
    """Writes ``head_block`` at the start of a buffer: one copy of bytes; on
    a GPU, one device copy of a cached block."""
    block = head_block(head, flags)
    if buf.device.type == "cpu":
        buf[: block.size].numpy()[:] = block
        return
    on = _WRITTEN_ON.get((head, flags, buf.device))
    if on is None:
        on = torch.from_numpy(block.copy()).to(buf.device)
        _WRITTEN_ON[(head, flags, buf.device)] = on
    buf[: on.numel()].copy_(on, non_blocking=True)


def host_bytes(buf: torch.Tensor, nbytes: int = _MIN_POST) -> torch.Tensor:
    """The first ``nbytes`` (at most) of a received buffer, on the host: the
    buffer itself on CPU, a copy from a GPU (ordered after the receive,
    which the current stream waits for)."""
    if buf.device.type == "cpu":
        return buf
    return buf[: min(buf.numel(), nbytes)].cpu()


def _message(total: int, flags: int, payload: bytes, size: int, device: torch.device) -> torch.Tensor:
    """A control message [total | flags][payload], padded to ``size`` bytes."""
    msg = torch.zeros(max(size, _PREFIX + len(payload)), dtype=torch.uint8)
    msg[:_PREFIX].view(torch.int64).copy_(torch.tensor([total, flags]))
    if payload:
        msg[_PREFIX : _PREFIX + len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return msg if device.type == "cpu" else msg.to(device)


_HEADS: dict[bytes, tuple[Layout, Spec, tuple[bool, ...]]] = {}


def read_head(buf: torch.Tensor, host: torch.Tensor | None = None
              ) -> tuple[int, int, Layout, Spec, tuple[bool, ...]]:
    """(data offset, flags, layout, spec, grads) of a received message.

    ``host``: the buffer's first bytes on the host, when ``buf`` is on a GPU
    (``host_bytes``). Decoded heads are cached by their bytes: a boundary
    sends the same head every microbatch, and reusing its Layout keeps the
    Layout's unpack plan."""
    if host is None and buf.device.type == "cpu":
        # Read through numpy: a few torch ops per message cost more than
        # the whole transfer of a narrow microbatch.
        data = buf.numpy()
        start, flags = _PREFIX_WORDS.unpack_from(data, 0)
        head = data[_PREFIX:start].tobytes()
    else:
        host = host_bytes(buf) if host is None else host
        start, flags = host[:_PREFIX].view(torch.int64).tolist()
        if start > host.numel():  # a head longer than the first bytes read
            host = host_bytes(buf, start)
        head = host[_PREFIX:start].numpy().tobytes()
    decoded = _HEADS.get(head)
    if decoded is None:
        layout, spec, grads = decode_head(head)
        decoded = (layout, spec, tuple(grads))
        if len(_HEADS) >= _HEADS_MAX:
            _HEADS.clear()
        _HEADS[head] = decoded
    return (start, flags, *decoded)


def received(buf: torch.Tensor, start: int, layout: Layout, grads: Sequence[bool]) -> list[torch.Tensor]:
    """The tensors of a message: views into ``buf`` (or cast copies with a wire
    dtype), flagged for autograd as the sender's were."""
    return [t.requires_grad_(g) for t, g in zip(unpack(buf[start:], layout), grads)]


def sender_orders(all_actions: Sequence[Sequence[Action]], me: int,
                  stage_to_rank: Sequence[int]) -> dict[int, deque]:
    """For every rank that sends to ``me``: the keys of its messages to ``me``,
    in the order it sends them (its lowered list's SEND order).

    A backend that matches a pair's messages by order (NCCL) needs the
    receiver to post in this order, which differs from the receiver's own
    RECV order in some V schedules (zbv on 2 ranks, dualpipev on 4)."""
    orders: dict[int, deque] = {}
    for src, actions in enumerate(all_actions):
        if src == me:
            continue
        for a in actions:
            if a.kind is Kind.SEND_F and stage_to_rank[a.stage + 1] == me:
                orders.setdefault(src, deque()).append(("F", a.stage + 1, a.microbatch))
            elif a.kind is Kind.SEND_B and stage_to_rank[a.stage - 1] == me:
                orders.setdefault(src, deque()).append(("B", a.stage - 1, a.microbatch))
    return orders


@dataclass
class _Posted:
    """A receive posted into a slot of its stream's ring."""

    work: dist.Work
    buf: torch.Tensor
    ring: BufferRing
    slot: int


class _DistRecv:
    """The pending receive the executor waits on (inline or on the lanes)."""

    def __init__(self, transport: DistTransport, src: int, key: Key, posted=None, event=None,
                 exact: bool = False):
        self.transport, self.src, self.key = transport, src, key
        self._posted, self._event, self._exact = posted, event, exact
        self._slot: tuple[BufferRing, int] | None = None

    def wait(self) -> Payload:
        if self._exact:
            tensors, spec, self._slot = self.transport._take_exact(self.src, self.key)
            return tensors, spec
        if self._event is not None:
            tensors, spec, self._slot = self._event.wait()
            return tensors, spec
        if self._posted is None:  # still in the window's queue: post it now
            self.transport._pump()
            if self._posted is None:
                raise AssertionError(f"receive of {_describe(self.key)} found no free buffer slot")
        tensors, spec, self._slot = self.transport._complete(self._posted, self.src, self.key)
        return tensors, spec

    def release(self) -> None:
        """The stage is done with the tensors (views into the slot): free the slot."""
        if self._slot is not None:
            ring, slot = self._slot
            self._slot = None
            ring.put(slot)
            if self._event is None:
                self.transport._pump()  # a slot is free: post the next receive


@dataclass
class DistTransport:
    """One rank of a pipeline over a process group: one packed message per transfer.

    Lives as long as its Pipe: the per-stream capacities it learns and its
    buffer rings carry over from step to step (see the comment above).
    ``finish`` ends a step. Receive buffers come from bounded rings sized by
    ``receive_slots`` for each action list the rank runs (training and
    inference differ): a slot per receive of the step, so inline mode posts
    them all when the step starts (why: ``receive_slots``); send buffers
    from growable rings.

    On NCCL (``exact``, ``buffers`` on the GPU, inline) ProcessGroupNCCL runs
    P2P on its own streams, which wait on the *current* stream when the call
    is made, and ``Work.wait()`` makes the current stream wait for the P2P.
    The Pipe runs the rank on its compute stream, so every call here is made
    from that stream: an isend is ordered after the kernels that packed its
    data; a receive's consumer (and the host copy of its head) after the
    receive; an irecv into a slot is posted after the compute-stream work of
    the slot's last reader, so the slot needs no event of its own; a send
    slot is reused only after ``is_completed()`` or ``wait()`` of its send.
    A wait first polls ``is_completed()`` on the host until ``timeout``, so a
    stuck peer raises TimeoutError instead of blocking a host copy forever.
    """

    group: dist.ProcessGroup | None
    device: torch.device
    stages: int
    timeout: float
    lanes: CommLanes | None = None
    wire: dict = field(default_factory=dict)  # direction ("F"/"B") -> wire dtype or None
    _sends: list = field(default_factory=list)
    _capacity: dict = field(default_factory=dict)
    _seen: dict = field(default_factory=dict)
    _recv_rings: dict = field(default_factory=dict)  # id(actions) -> {stream: BufferRing}
    _send_rings: dict = field(default_factory=dict)  # stream -> BufferRing
    _rings: dict = field(default_factory=dict)  # this step's receive rings
    _events: list = field(default_factory=list)  # this step's lane tasks
    _expected: list = field(default_factory=list)  # this step's receives: [(key, src)]
    _posted: set = field(default_factory=set)  # keys whose receive was posted
    _window: deque = field(default_factory=deque)  # inline: receives not posted yet
    _mode: int = 0  # this step's message flag: step_mode

    posts_ahead = True  # every receive of a step is handed over when it starts

    stage_to_rank: tuple = ()  # the schedule's placement (set by the Pipe)
    # NCCL: every message exactly the size its receiver posted (see above),
    # in buffers on this device.
    exact: bool = False
    buffers: torch.device = torch.device("cpu")
    late: dict = field(default_factory=dict)  # exact: where notices' follow-ups go (late_groups)
    rank: int = -1  # this rank in the pipeline (exact: to know who sends what, in which order)
    all_actions: Sequence = ()  # exact: every rank's lowered list of the step (set by the Pipe)
    # exact, per step: keys each peer sends us, in its order, not yet posted;
    # posted receives not yet completed, in that order; completed, not taken.
    _orders: dict = field(default_factory=dict)  # id(all_actions) -> sender_orders(...)
    _order: dict = field(default_factory=dict)
    _inflight: dict = field(default_factory=dict)
    _ready: dict = field(default_factory=dict)
    # "up" / "down" -> the process group for messages to a higher / lower
    # rank (flow_groups); without them everything uses ``group``.
    groups: dict = field(default_factory=dict)

    def peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _owner(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def _group(self, key: Key, groups: dict | None = None) -> dist.ProcessGroup | None:
        """The group a message travels on: by the way it goes between ranks
        (``groups``: the follow-ups' late groups instead of the flow groups)."""
        groups = self.groups if groups is None else groups
        if not groups:
            return self.group
        direction, stage, _ = key
        src = self._owner(stage - 1 if direction == "F" else stage + 1)
        return groups["up" if src < self._owner(stage) else "down"]

    def tag(self, key: Key) -> int:
        if self.exact:
            return 0  # matched by order, as NCCL does (which ignores tags)
        direction, stage, mb = key
        return ((mb * self.stages + stage) * 2 + (direction == "B")) * 2

    def _posted_size(self, stream: Stream) -> int:
        """Bytes the receiver of ``stream`` posts: what an exact message is padded to."""
        return max(self._capacity.get(stream, 0), _MIN_POST)

    def _note(self, key: Key, nbytes: int) -> None:
        stream = key[:2]
        self._seen[stream] = max(self._seen.get(stream, 0), nbytes)

    def begin(self, actions: Sequence[Action]) -> None:
        """Picks (or makes) the receive rings for this action list."""
        rings = self._recv_rings.get(id(actions))
        if rings is None:
            rings = {
                # exact: receives follow the senders' order, which may need a
                # slot before this rank's own order frees one: grow then.
                stream: BufferRing(n, self.buffers, growable=self.exact, timeout=self.timeout)
                for stream, n in receive_slots(actions).items()
            }
            self._recv_rings[id(actions)] = rings
        self._rings = rings
        self._mode = step_mode(actions)
        self._sends = []
        self._events = []
        self._posted = set()
        self._window = deque()
        self._expected = []
        if self.exact:
            orders = self._orders.get(id(self.all_actions))
            if orders is None:  # the lists live as long as the Pipe, like the rings above
                orders = sender_orders(self.all_actions, self.rank, self.stage_to_rank)
                self._orders[id(self.all_actions)] = orders
            self._order = {src: deque(keys) for src, keys in orders.items()}
            self._inflight = {src: deque() for src in self._order}
            self._ready = {}
        for a in actions:
            if a.kind is Kind.RECV_F:
                self._expected.append((("F", a.stage, a.microbatch), self._owner(a.stage - 1)))
            elif a.kind is Kind.RECV_B:
                self._expected.append((("B", a.stage, a.microbatch), self._owner(a.stage + 1)))

    def rings(self) -> dict[str, dict[Stream, BufferRing]]:
        """This step's receive rings and every send ring (for tests and stats)."""
        return {"recv": dict(self._rings), "send": dict(self._send_rings)}

    # --- send: pack into a slot, isend; later wait and free the slot ------------

    def send(self, tensors: list[torch.Tensor], spec: Spec, dst: int, key: Key) -> None:
        if self.lanes is None:
            self._reap()
            self._sends.append(self._issue(tensors, spec, dst, key))
            return
        ring = self.lanes.ring
        issued = ring.submit(self.lanes.send,
                             with_caller_threads(lambda: self._issue(tensors, spec, dst, key)))
        done = ring.submit(self.lanes.send_done,
                           with_caller_threads(lambda: self._settle(issued.wait())), [issued])
        self._sends.append(done)
        self._events += (issued, done)

    def _issue(self, tensors, spec, dst, key) -> list:
        tag, peer, group = self.tag(key), self.peer(dst), self._group(key)
        layout = Layout.plan(tensors, self.wire.get(key[0]))
        head = encode_head(layout, spec, [needs_grad(t) for t in tensors])
        start = _prefixed(head)
        total = start + layout.nbytes
        self._note(key, total)
        posted = self._posted_size(key[:2]) if self.exact else 0
        if total > self._capacity.get(key[:2], 0):
            # Over capacity: announce the size on the posted tag, send on the next.
            notice = _message(total, _OVERSIZE, b"", posted, self.buffers)
            # A one-off size: not worth a slot.
            buf = torch.empty(total, dtype=torch.uint8, device=self.buffers)
            write_head(buf, head, self._mode)
            pack_into(buf[start:], tensors, layout)
            late, late_tag = self._late(key)
            return [(dist.isend(notice, dst=peer, group=group, tag=tag), notice, None, -1, dst),
                    (dist.isend(buf, dst=peer, group=late, tag=late_tag), buf, None, -1, dst)]
        ring = self._send_rings.get(key[:2])
        if ring is None:
            ring = self._send_rings[key[:2]] = BufferRing(
                1, self.buffers, growable=True, timeout=self.timeout
            )
        slot, buf = ring.get(max(total, posted))  # exact: padded to what the receiver posted
        write_head(buf, head, self._mode)
        pack_into(buf[start:], tensors, layout)
        return [(dist.isend(buf, dst=peer, group=group, tag=tag), buf, ring, slot, dst)]

    def _reap(self) -> None:
        """Inline mode: frees the slots of the oldest sends that have completed."""
        # gloo marks a work completed only inside wait(), so this frees slots
        # only on backends that report completion on their own.
        while self._sends and all(work.is_completed() for work, *_ in self._sends[0]):
            self._settle(self._sends.pop(0))

    def _settle(self, issued: list) -> None:
        for work, _buf, ring, slot, dst in issued:
            self._wait(work, f"a send to rank {dst} (it must post the matching receive)", dst)
            if ring is not None:
                ring.put(slot)

    # --- receive: take a slot, irecv; later wait and unpack (views) --------------

    def recv(self, src: int, key: Key) -> _DistRecv:
        if self.exact:  # posted in the sender's order (begin), completed in it too
            pending = _DistRecv(self, src, key, exact=True)
            self._pump()
            return pending
        if self.lanes is None:
            # Inline: receives wait in a queue, in schedule order, and are posted
            # on this thread as soon as their stream's ring has a free slot.
            pending = _DistRecv(self, src, key)
            self._window.append(pending)
            self._pump()
            return pending
        ring = self.lanes.ring
        posted = ring.submit(self.lanes.post, with_caller_threads(lambda: self._post(src, key)))
        done = ring.submit(
            self.lanes.recv_done,
            with_caller_threads(lambda: self._complete(posted.wait(), src, key)), [posted],
        )
        self._events += (posted, done)
        return _DistRecv(self, src, key, event=done)

    def _pump(self) -> None:
        """Posts queued receives, oldest first, while their rings have free slots.

        Stops at the first receive whose ring is full, so receives are posted
        in schedule order. Exact messages: per peer, in the order it sends.
        """
        if self.exact:
            for src, order in self._order.items():
                while order:
                    ring = self._rings[order[0][:2]]
                    if ring.held >= ring.size:
                        break
                    self._post_next(src)
            return
        while self._window:
            pending = self._window[0]
            ring = self._rings[pending.key[:2]]
            if ring.held >= ring.size:
                return
            self._window.popleft()
            pending._posted = self._post(pending.src, pending.key)

    def _post_next(self, src: int) -> None:
        """Exact: posts the next receive from ``src`` in its send order."""
        key = self._order[src].popleft()
        self._inflight[src].append((key, self._post(src, key)))

    def _take_exact(self, src: int, key: Key):
        """Exact: completes ``src``'s receives in its send order up to ``key``
        (posting them if needed: the ring grows rather than wait), keeping the
        others for their consumers; returns ``key``'s (tensors, spec, slot)."""
        while key not in self._ready:
            if not self._inflight[src]:
                if not self._order[src]:
                    raise AssertionError(f"rank {src} sends no {_describe(key)} in this step")
                self._post_next(src)
            k, posted = self._inflight[src].popleft()
            self._ready[k] = self._complete(posted, src, k)
        return self._ready.pop(key)

    def _late(self, key: Key) -> tuple[dist.ProcessGroup | None, int]:
        """(group, tag) of the full message that follows an oversize notice."""
        if self.exact:
            return self._group(key, self.late), 0
        return self._group(key), self.tag(key) + 1

    def _irecv_late(self, buf: torch.Tensor, src: int, key: Key) -> dist.Work:
        """The receive of the full message that follows an oversize notice."""
        group, tag = self._late(key)
        return dist.irecv(buf, src=self.peer(src), group=group, tag=tag)

    def _post(self, src: int, key: Key) -> _Posted:
        ring = self._rings[key[:2]]
        slot, buf = ring.get(self._posted_size(key[:2]))
        try:
            work = dist.irecv(buf, src=self.peer(src), group=self._group(key), tag=self.tag(key))
        except BaseException:
            ring.put(slot)
            raise
        self._posted.add(key)
        return _Posted(work, buf, ring, slot)

    def _complete(self, posted: _Posted, src: int, key: Key):
        """Waits for a posted receive; returns (tensors, spec, slot still held or None)."""
        what = f"{_describe(key)} from rank {src}"
        held: tuple[BufferRing, int] | None = (posted.ring, posted.slot)
        try:
            self._wait(posted.work, what, src)
            buf = posted.buf
            host = host_bytes(buf)  # one copy to the host on a GPU: prefix and head
            total, flags = host[:_PREFIX].view(torch.int64).tolist()
            if flags & _ABORT:
                reason = bytes(host[_PREFIX : min(total, host.numel())].tolist())
                raise PeerError(f"pipeline rank {src} failed: {reason.decode('utf-8', 'replace')}")
            if flags & _OVERSIZE:  # a notice: the message follows on the next tag
                posted.ring.put(posted.slot)
                held = None
                buf = torch.empty(total, dtype=torch.uint8, device=self.buffers)
                work = self._irecv_late(buf, src, key)
                self._wait(work, what, src)
                host = host_bytes(buf)
            start, flags, layout, spec, grads = read_head(buf, host)
            check_mode(flags, self._mode, src, key)
            self._note(key, start + layout.nbytes)
            tensors = received(buf, start, layout, grads)
            staged = buf.device.type != self.device.type  # gloo with a GPU: host buffers
            copied = staged or all(s.wire is not None for s in layout.slots)
            if staged:
                tensors = [x.detach().to(self.device).requires_grad_(x.requires_grad) for x in tensors]
            if copied and held is not None:
                posted.ring.put(posted.slot)  # no view into the slot is left
                held = None
        except BaseException:
            if held is not None:
                held[0].put(held[1])
            raise
        return tensors, spec, held

    def _wait(self, work: dist.Work, what: str, peer: int | None = None) -> None:
        if self.buffers.type == "cuda":
            # NCCL reports completion by itself; wait for it on the host with
            # our deadline, so a stuck peer ends in a TimeoutError here rather
            # than in a host copy that never returns.
            deadline, nap = time.monotonic() + self.timeout, 2e-5
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(_timeout_message(what, self.timeout, peer))
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)
        try:
            done = work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as err:  # gloo reports its timeout as a RuntimeError
            text = str(err).lower()
            if "closed by peer" in text or "connection reset" in text or "broken pipe" in text:
                who = f"pipeline rank {peer}" if peer is not None else "a peer rank"
                raise PeerError(f"{who} is gone (its process died or closed the connection) "
                                f"while waiting for {what}") from err
            if "timed out" not in text and "timeout" not in text:
                raise
            raise TimeoutError(_timeout_message(what, self.timeout, peer)) from err
        if not done:
            raise TimeoutError(_timeout_message(what, self.timeout, peer))

    def finish(self) -> None:
        """Waits for this step's sends, then grows the capacities for the next step.

        Both ends of a stream saw the same payloads this step, so they grow
        its capacity to the same value.
        """
        sends, self._sends = self._sends, []
        for item in sends:
            if isinstance(item, list):
                self._settle(item)
            else:
                item.wait()
        for stream, nbytes in self._seen.items():
            self._capacity[stream] = max(self._capacity.get(stream, 0), nbytes)
        self._seen.clear()

    def fail(self, exc: BaseException, unsent=()) -> None:
        """Tells the peers, drops the step's state and frees every buffer slot.

        Every message of the step this rank still owed (``unsent``) is
        replaced by an abort notice carrying the reason, so a peer waiting for
        one fails at once with a PeerError naming this rank (and passes the
        news on the same way). Notices wait at most a few seconds to be taken.
        After a failure the process group holds stale messages: the Pipe
        refuses further steps.
        """
        for rings in self._recv_rings.values():  # no more receives get posted
            for ring in rings.values():
                ring.cancel(f"the step failed: {exc!r}")
        if not isinstance(exc, PeerError):  # a peer's failure is passed on as ours
            reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = str(exc)
        payload = reason.encode("utf-8")[: _MIN_POST - _PREFIX]
        notices = []
        for key, dst in unsent:
            size = self._posted_size(key[:2]) if self.exact else 0
            msg = _message(_PREFIX + len(payload), _ABORT, payload, size, self.buffers)
            try:
                notices.append((dist.isend(msg, dst=self.peer(dst), group=self._group(key), tag=self.tag(key)), msg))
            except RuntimeError:
                break  # the connection is gone already
        # Take in what the peers still send this step (their data, or their
        # own notices once they fail too), so their sends complete and so do
        # the receives our lanes posted: no thread is left inside a gloo wait
        # when the error reaches the caller.
        deadline = time.monotonic() + min(self.timeout, 10.0)
        for key, src, work, buf in self._drain():
            self._finish_drain(key, src, work, buf, deadline)
        # The notices, and the data sends issued before the failure, must
        # leave before this process may exit: an isend not waited for can
        # still sit in gloo's queue when the caller tears the process group
        # down, and the peer then sees a closed connection ("rank N is gone")
        # instead of the reason (1 run in ~20 of the fault tests did for the
        # notices; with them waited for, a peer still waiting for a message
        # sent just before the failure saw the same under a loaded machine).
        issued = [work for item in self._sends if isinstance(item, list) for work, *_ in item]
        for work in issued + [work for work, _msg in notices]:
            if not _wait_until(work, deadline):
                break  # past the deadline, or the peer is gone: it needs no notice
        for event in self._events:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                event.wait(left)
            except BaseException:  # noqa: BLE001 - the lanes' own failures are expected here
                pass
        self._events = []
        self._sends = []
        self._seen.clear()
        for ring in self._send_rings.values():
            ring.cancel(f"the step failed: {exc!r}")


    def _drain(self) -> list:
        """Posts a receive for every message of the step not yet posted.

        Exact: per peer, the receives it already has in flight and then the
        rest, in its send order (matching is by order)."""
        out, todo = [], []
        if self.exact:
            for src, order in self._order.items():
                out += [(key, src, posted.work, posted.buf) for key, posted in self._inflight[src]]
                self._inflight[src].clear()
                todo += [(key, src) for key in order]
                order.clear()
        else:
            todo = [(key, src) for key, src in self._expected if key not in self._posted]
        for key, src in todo:
            buf = torch.empty(self._posted_size(key[:2]), dtype=torch.uint8, device=self.buffers)
            try:
                work = dist.irecv(buf, src=self.peer(src), group=self._group(key), tag=self.tag(key))
            except RuntimeError:
                break  # the connection is gone
            out.append((key, src, work, buf))
        return out

    def _finish_drain(self, key, src, work, buf, deadline: float) -> None:
        """Waits (until ``deadline``) for a drained message; follows an oversize notice.

        gloo only learns that a receive completed inside ``wait`` (its
        ``is_completed`` stays False until then), and a wait that times out
        closes the connection: acceptable here, the step has failed anyway.
        """
        try:
            if not _wait_until(work, deadline):
                return
            total, flags = host_bytes(buf, _PREFIX)[:_PREFIX].view(torch.int64).tolist()
            if flags & _OVERSIZE:
                full = torch.empty(total, dtype=torch.uint8, device=self.buffers)
                rest = self._irecv_late(full, src, key)
                _wait_until(rest, deadline)
        except RuntimeError:
            pass  # the peer is gone: nothing left to take in


def _wait_until(work: dist.Work, deadline: float) -> bool:
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    try:
        return bool(work.wait(timedelta(seconds=left)))
    except RuntimeError:
        return False


def _timeout_message(what: str, timeout: float, peer: int | None) -> str:
    hint = (f"; pipeline rank {peer} may be stuck, slow, or in another call (every rank must "
            "call step() together, or pipe(x) together)") if peer is not None else ""
    return f"{what} not done within timeout={timeout} s{hint} (Pipe(timeout=...) sets the limit)"
