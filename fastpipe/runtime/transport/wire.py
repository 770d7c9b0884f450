"""The message format between ranks: a prefix, a head, then the packed data.

One message per transfer: a 16-byte prefix, a head that says what the data
is (value structure, gradient flags, the packing Layout), then the data as
``fastpipe.pack`` lays it out (16-byte aligned slots, optional wire dtype):

  [ head bytes | flags ][ spec kind, grads, Layout, pickled spec ][ data ... ]
  '--- 16 bytes -------''------- head (padded to 16) -------------'

One message, not one per tensor, so a transfer costs one send whatever the
value's structure. ``fastpipe.runtime.transport.dist`` and
``fastpipe.runtime.shm`` both speak it.

Over torch.distributed the receiver posts its buffer before the data
exists, so it must guess the size: each stream (direction, stage) has a
capacity that both ends derive from the same history (the largest message
of earlier steps), so they agree without talking. gloo accepts a message
shorter than the posted buffer. A message over capacity goes as a 16-byte
notice [total bytes | OVERSIZE] on the posted tag, followed by the full
message on the next tag. A rank that fails sends [length | ABORT][reason]
on the tag of every message it still owed, so whoever waits for one learns
who failed and why, at once. With exact messages (NCCL) every message on a
posted tag is padded to the size the receiver posted, max(capacity,
MIN_POST), which both ends know.
"""

from __future__ import annotations

import pickle
import struct
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from fastpipe._microbatch import Spec
from fastpipe.runtime.packing import Layout, aligned, unpack
from fastpipe.runtime.transport.base import Key, describe
from fastpipe.schedules import Action, Kind

__all__ = [
    "ABORT", "INFERENCE", "MIN_POST", "OVERSIZE", "PREFIX", "CallMismatch", "check_mode",
    "control_message", "decode_head", "encode_head", "head_block", "host_bytes", "prefixed",
    "read_head", "received", "sender_orders", "step_mode", "write_head",
]

PREFIX = 16  # bytes of the prefix: data offset, flags
_PREFIX_WORDS = struct.Struct("=qq")  # data offset, flags
OVERSIZE = 1  # a notice: the full message follows on the next tag (or the late groups)
ABORT = 2  # the sender failed: the rest of the message is its reason (utf-8)
# Sent from pipe(x) (inference), not step(): the keys are the same, so a
# rank that receives a message of the other kind knows its peer is in
# another call and fails the step at once instead of waiting out the timeout.
INFERENCE = 4
MIN_POST = 256  # bytes of a receive buffer before any size is known (>= any notice)
_HEAD = struct.Struct("<BHI")  # spec kind, tensors, pickled-spec bytes


def step_mode(actions: Sequence[Action]) -> int:
    """The flag a rank's messages carry for this action list: ``INFERENCE``
    unless it has backward actions (every rank's training list has)."""
    backward = (Kind.B, Kind.I, Kind.W)
    return 0 if any(a.kind in backward for a in actions) else INFERENCE


class CallMismatch(RuntimeError):
    """A peer is in another call (``step`` here, ``pipe(x)`` there, or the reverse)."""


def check_mode(flags: int, mode: int, src: int, key: Key) -> None:
    """Raises CallMismatch when a message was sent from the other call than this rank's."""
    if flags & INFERENCE != mode:
        theirs, ours = ("pipe(x)", "step()") if flags & INFERENCE else ("step()", "pipe(x)")
        raise CallMismatch(
            f"pipeline rank {src} runs {theirs} while this rank runs {ours} ({describe(key)} "
            "came from it): every rank must make the same call, step() together or pipe(x) "
            "together")


def encode_head(layout: Layout, spec: Spec, grads: Sequence[bool]) -> bytes:
    """What a receiver needs to read a packed message (see the module docstring)."""
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


def prefixed(head: bytes) -> int:
    """Bytes of prefix + head, padded so the data starts 16-byte aligned."""
    return aligned(PREFIX + len(head))


_HEADS_MAX = 1024  # entries of each head cache below (a boundary has one or a few heads)
_WRITTEN: dict[tuple[bytes, int], np.ndarray] = {}  # (head, flags) -> prefix + head bytes
_WRITTEN_ON: dict[tuple[bytes, int, torch.device], torch.Tensor] = {}  # the same, on a GPU


def head_block(head: bytes, flags: int = 0) -> np.ndarray:
    """The prefix (data offset, flags) and the head as one block of bytes,
    made once per head (a boundary sends the same head every microbatch)."""
    block = _WRITTEN.get((head, flags))
    if block is None:
        block = np.frombuffer(_PREFIX_WORDS.pack(prefixed(head), flags) + head, dtype=np.uint8)
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


def host_bytes(buf: torch.Tensor, nbytes: int = MIN_POST) -> torch.Tensor:
    """The first ``nbytes`` (at most) of a received buffer, on the host: the
    buffer itself on CPU, a copy from a GPU (ordered after the receive,
    which the current stream waits for)."""
    if buf.device.type == "cpu":
        return buf
    return buf[: min(buf.numel(), nbytes)].cpu()


def control_message(total: int, flags: int, payload: bytes, size: int,
                    device: torch.device) -> torch.Tensor:
    """A control message [total | flags][payload], padded to ``size`` bytes."""
    msg = torch.zeros(max(size, PREFIX + len(payload)), dtype=torch.uint8)
    msg[:PREFIX].view(torch.int64).copy_(torch.tensor([total, flags]))
    if payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        msg[PREFIX : PREFIX + len(payload)].copy_(data)
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
        head = data[PREFIX:start].tobytes()
    else:
        host = host_bytes(buf) if host is None else host
        start, flags = host[:PREFIX].view(torch.int64).tolist()
        if start > host.numel():  # a head longer than the first bytes read
            host = host_bytes(buf, start)
        head = host[PREFIX:start].numpy().tobytes()
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
