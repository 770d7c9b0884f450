"""One rank of a pipeline over torch.distributed: one packed message per transfer.

Messages follow ``wire``'s format and size protocol. Receives are posted
ahead into bounded rings of buffers, so a message lands when it is sent
rather than when its consumer asks for it. Messages up and down the ranks
travel on two groups of their own (``groups.flow_groups``).

NCCL needs every receive exactly the size of its send and matches a pair's
messages by order (it ignores tags). With ``exact``:
- every message on a posted tag (data, notice or abort) is padded to the
  size the receiver posted, max(capacity, MIN_POST), which both ends know;
- every tag is 0, and the receiver posts and completes each peer's
  messages in the order that peer sends them (``wire.sender_orders``),
  keeping those its consumers do not need yet;
- the full message after an oversize notice goes on groups of their own
  (``groups.late_groups``), in the same order, exactly the announced total;
- the buffers live on the GPU (``buffers``) and the receiver copies the
  first bytes (prefix and head) to the host to read them; lanes mode is not
  used (NCCL's own streams overlap the transfers).
Why each rule: ``docs/design/transports.md``, "NCCL's rules".

How a failing rank tells its peers, and drains the step: ``abort``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fastpipe._microbatch import Spec, needs_grad
from fastpipe.runtime.buffers import BufferRing, Stream, receive_slots
from fastpipe.runtime.packing import Layout, pack_into
from fastpipe.runtime.threads import with_caller_threads
from fastpipe.runtime.transport.abort import fail_step
from fastpipe.runtime.transport.base import (
    CommLanes, Held, Key, PeerError, SlotReceive, describe, timeout_message,
)
from fastpipe.runtime.transport.wire import (
    ABORT, MIN_POST, OVERSIZE, PREFIX, check_mode, control_message, encode_head, host_bytes,
    prefixed, read_head, received, sender_orders, step_mode, write_head,
)
from fastpipe.schedules import Action, Kind

__all__ = ["DistTransport"]


_KEPT = 2  # action lists whose rings (or orders) a transport keeps: a Pipe's training and inference


def _cached(cache: dict, actions: Sequence, make):
    """``cache``'s value for this very list (by identity: a list's id may be
    reused once it is gone), made on a miss; the oldest of more than
    ``_KEPT`` lists goes (a Pipe that reorders its schedule leaves two behind)."""
    hit = cache.get(id(actions))
    if hit is not None and hit[0] is actions:
        return hit[1]
    value = make()
    cache.pop(id(actions), None)
    cache[id(actions)] = (actions, value)
    while len(cache) > _KEPT:
        del cache[next(iter(cache))]
    return value


@dataclass
class _Posted:
    """A receive posted into a slot of its stream's ring."""

    work: dist.Work
    buf: torch.Tensor
    ring: BufferRing
    slot: int


class _DistRecv(SlotReceive):
    """The pending receive the executor waits on (inline or on the lanes)."""

    def __init__(self, transport: DistTransport, src: int, key: Key, posted=None, event=None,
                 exact: bool = False):
        self.transport, self.src, self.key = transport, src, key
        self._posted, self._event, self._exact = posted, event, exact

    def _take(self) -> tuple[list[torch.Tensor], Any, Held | None]:
        if self._exact:
            return self.transport._take_exact(self.src, self.key)
        if self._event is not None:
            return self._event.wait()
        if self._posted is None:  # still in the window's queue: post it now
            self.transport._pump()
            if self._posted is None:
                raise AssertionError(f"receive of {describe(self.key)} found no free buffer slot")
        return self.transport._complete(self._posted, self.src, self.key)

    def _hand_back(self, ring: BufferRing, slot: int) -> None:
        """The stage is done with the tensors (views into the slot): free the slot."""
        ring.put(slot)
        if self._event is None:
            self.transport._pump()  # a slot is free: post the next receive


@dataclass
class DistTransport:
    """One rank of a pipeline over a process group: one packed message per transfer.

    Lives as long as its Pipe: the per-stream capacities it learns and its
    buffer rings carry over from step to step (see ``wire``).
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
    _recv_rings: dict = field(default_factory=dict)  # id(actions) -> (actions, {stream: BufferRing})
    _send_rings: dict = field(default_factory=dict)  # stream -> BufferRing
    _rings: dict = field(default_factory=dict)  # this step's receive rings
    _events: list = field(default_factory=list)  # this step's lane tasks
    _expected: list = field(default_factory=list)  # this step's receives: [(key, src)]
    _posted: set = field(default_factory=set)  # keys whose receive was posted
    _window: deque = field(default_factory=deque)  # inline: receives not posted yet
    _mode: int = 0  # this step's message flag: step_mode

    posts_ahead = True  # every receive of a step is handed over when it starts

    stage_to_rank: tuple = ()  # the schedule's placement (set by the Pipe)
    # NCCL: every message exactly the size its receiver posted (see the module docstring),
    # in buffers on this device.
    exact: bool = False
    buffers: torch.device = torch.device("cpu")
    late: dict = field(default_factory=dict)  # exact: where notices' follow-ups go (late_groups)
    rank: int = -1  # this rank in the pipeline (exact: to know who sends what, in which order)
    all_actions: Sequence = ()  # exact: every rank's lowered list of the step (set by the Pipe)
    # exact, per step: keys each peer sends us, in its order, not yet posted;
    # posted receives not yet completed, in that order; completed, not taken.
    _orders: dict = field(default_factory=dict)  # id(all_actions) -> (all_actions, sender_orders(...))
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
        return max(self._capacity.get(stream, 0), MIN_POST)

    def _note(self, key: Key, nbytes: int) -> None:
        stream = key[:2]
        self._seen[stream] = max(self._seen.get(stream, 0), nbytes)

    def begin(self, actions: Sequence[Action]) -> None:
        """Picks (or makes) the receive rings for this action list."""
        rings = _cached(self._recv_rings, actions, lambda: {
            # exact: receives follow the senders' order, which may need a
            # slot before this rank's own order frees one: grow then.
            stream: BufferRing(n, self.buffers, growable=self.exact, timeout=self.timeout)
            for stream, n in receive_slots(actions).items()
        })
        self._rings = rings
        self._mode = step_mode(actions)
        self._sends = []
        self._events = []
        self._posted = set()
        self._window = deque()
        self._expected = []
        if self.exact:
            orders = _cached(self._orders, self.all_actions,
                             lambda: sender_orders(self.all_actions, self.rank, self.stage_to_rank))
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
        start = prefixed(head)
        total = start + layout.nbytes
        self._note(key, total)
        posted = self._posted_size(key[:2]) if self.exact else 0
        if total > self._capacity.get(key[:2], 0):
            # Over capacity: announce the size on the posted tag, send on the next.
            notice = control_message(total, OVERSIZE, b"", posted, self.buffers)
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
                    raise AssertionError(f"rank {src} sends no {describe(key)} in this step")
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
        what = f"{describe(key)} from rank {src}"
        held: tuple[BufferRing, int] | None = (posted.ring, posted.slot)
        try:
            self._wait(posted.work, what, src)
            buf = posted.buf
            host = host_bytes(buf)  # one copy to the host on a GPU: prefix and head
            total, flags = host[:PREFIX].view(torch.int64).tolist()
            if flags & ABORT:
                reason = bytes(host[PREFIX : min(total, host.numel())].tolist())
                raise PeerError(f"pipeline rank {src} failed: {reason.decode('utf-8', 'replace')}")
            if flags & OVERSIZE:  # a notice: the message follows on the next tag
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
                    raise TimeoutError(timeout_message(what, self.timeout, peer))
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
            raise TimeoutError(timeout_message(what, self.timeout, peer)) from err
        if not done:
            raise TimeoutError(timeout_message(what, self.timeout, peer))

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

    def fail(self, exc: BaseException, unsent: Iterable[tuple[Key, int]] = ()) -> None:
        """Tells the peers, drops the step's state and frees every buffer slot.

        Every message of the step this rank still owed (``unsent``) is
        replaced by an abort notice carrying the reason, so a peer waiting for
        one fails at once with a PeerError naming this rank (and passes the
        news on the same way). Notices wait at most a few seconds to be taken.
        After a failure the process group holds stale messages: the Pipe
        refuses further steps. How: ``abort.fail_step``.
        """
        fail_step(self, exc, unsent)
