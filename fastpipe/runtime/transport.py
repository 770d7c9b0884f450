"""Moving stage values between pipeline ranks: in one process, or over torch.distributed.

Both transports take the same verbs, so the executor has one code path:

    send(tensors, is_tuple, dst, key)   non-blocking; the tensors must not be
                                        modified afterwards
    recv(src, key) -> Pending           posts the receive; Pending.wait()
                                        returns (tensors, is_tuple)
    finish()                            waits for outstanding sends
    fail(exc)                           marks this rank failed: local peers stop
                                        waiting at once; a distributed rank drops
                                        its step state (peers see their timeout)

``key`` is ``(direction, stage, microbatch)``: ``"F"`` for activations going
to ``stage``, ``"B"`` for gradients going to ``stage``. Keys make matching
independent of the order in which two ranks issue their operations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fastpipe._microbatch import needs_grad

Key = tuple[str, int, int]
Payload = tuple[list[torch.Tensor], bool]


class PeerError(RuntimeError):
    """Raised on a rank whose peer failed first; the peer's error is the cause."""


class Mailbox:
    """Shared by the ranks of a local pipeline: one slot per key."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._slots: dict[Key, Payload] = {}
        self._failed: tuple[int, BaseException] | None = None

    def put(self, key: Key, payload: Payload) -> None:
        with self._cond:
            self._slots[key] = payload
            self._cond.notify_all()

    def take(self, key: Key, timeout: float) -> Payload:
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._slots:
                if self._failed is not None:
                    rank, exc = self._failed
                    raise PeerError(f"pipeline rank {rank} failed: {exc!r}") from exc
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no message for {_describe(key)} within timeout={timeout} s")
                self._cond.wait(left)
            return self._slots.pop(key)

    def fail(self, rank: int, exc: BaseException) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = (rank, exc)
            self._cond.notify_all()

    @property
    def first_failure(self) -> tuple[int, BaseException] | None:
        return self._failed


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


class LocalTransport:
    """Ranks in one process, each on its own device; a send is a device copy."""

    def __init__(self, mailbox: Mailbox, rank: int, devices: Sequence[torch.device], timeout: float):
        self.mailbox, self.rank, self.devices, self.timeout = mailbox, rank, devices, timeout

    def send(self, tensors: list[torch.Tensor], is_tuple: bool, dst: int, key: Key) -> None:
        device = self.devices[dst]
        # Blocking copies: the consumer runs on another thread, with no stream sync.
        moved = [_mark(t.detach().to(device), t) for t in tensors]
        self.mailbox.put(key, (moved, is_tuple))

    def recv(self, src: int, key: Key) -> _MailboxRecv:
        return _MailboxRecv(self.mailbox, key, self.timeout)

    def finish(self) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        self.mailbox.fail(self.rank, exc)


def _mark(copy: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Carries over whether the sender's tensor takes part in backward."""
    return copy.requires_grad_(needs_grad(original))


# --- torch.distributed -------------------------------------------------------
#
# One message per transfer: a flat byte buffer, a 64-word header in front
# (sizes, dtypes, shapes), then every tensor at a 16-byte aligned offset.
#
#   [ nbytes | oversize | is_tuple | n | (dtype, grad, ndim, *shape)... ][ data ... ]
#   '------------------------ 512 bytes -------------------------------'
#
# The receiver posts its buffer before the data exists, so it must guess the
# size: each stream (direction, stage) has a capacity that both ends derive
# from the same history (the largest payload of earlier steps), so they agree
# without talking. gloo accepts a message shorter than the posted buffer. A
# payload over capacity goes as a header-only message on the posted tag (flag
# set) followed by the full message on the next tag.

_HEADER = 64
_HEADER_BYTES = _HEADER * 8
_ALIGN = 16
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def encode_header(tensors: Sequence[torch.Tensor], is_tuple: bool, oversize: bool = False) -> list[int]:
    """The header words describing a payload (count, dtypes, shapes, total bytes)."""
    words = [sum(_aligned(_nbytes(t)) for t in tensors), int(oversize), int(is_tuple), len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages")
        words += [_CODE[t.dtype], int(needs_grad(t)), t.dim(), *t.shape]
    if len(words) > _HEADER:
        raise ValueError(
            f"stage value too complex to describe: {len(tensors)} tensors need {len(words)} "
            f"header words, at most {_HEADER}"
        )
    return words + [0] * (_HEADER - len(words))


def decode_header(words: list[int]) -> tuple[int, bool, bool, list[tuple[torch.dtype, bool, list[int]]]]:
    """Inverse of ``encode_header``: (nbytes, oversize, is_tuple, [(dtype, grad, shape)])."""
    nbytes, oversize, is_tuple, n, pos, specs = words[0], bool(words[1]), bool(words[2]), words[3], 4, []
    for _ in range(n):
        dtype, grad, ndim = _DTYPES[words[pos]], bool(words[pos + 1]), words[pos + 2]
        specs.append((dtype, grad, words[pos + 3 : pos + 3 + ndim]))
        pos += 3 + ndim
    return nbytes, oversize, is_tuple, specs


def pack(tensors: Sequence[torch.Tensor], words: list[int]) -> torch.Tensor:
    """One uint8 buffer: header words, then each tensor at an aligned offset."""
    buf = torch.empty(_HEADER_BYTES + words[0], dtype=torch.uint8)
    buf[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
    off = _HEADER_BYTES
    for t in tensors:
        n = _nbytes(t)
        buf[off : off + n].view(t.dtype).view(t.shape).copy_(t.detach())
        off += _aligned(n)
    return buf


def unpack(buf: torch.Tensor, specs) -> list[torch.Tensor]:
    """Views into ``buf`` (no copy), flagged for autograd as the sender's were."""
    out, off = [], _HEADER_BYTES
    for dtype, grad, shape in specs:
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        out.append(buf[off : off + n].view(dtype).view(shape).requires_grad_(grad))
        off += _aligned(n)
    return out


@dataclass
class _DistRecv:
    transport: DistTransport
    src: int
    key: Key
    buf: torch.Tensor
    work: dist.Work

    def wait(self) -> Payload:
        t = self.transport
        t._wait(self.work, f"{_describe(self.key)} from rank {self.src}")
        nbytes, oversize, is_tuple, specs = decode_header(self.buf[:_HEADER_BYTES].view(torch.int64).tolist())
        buf = self.buf
        if oversize:
            buf = torch.empty(_HEADER_BYTES + nbytes, dtype=torch.uint8)
            work = dist.irecv(buf, src=t.peer(self.src), group=t.group, tag=t.tag(self.key) + 1)
            t._wait(work, f"{_describe(self.key)} from rank {self.src}")
        t._note(self.key, nbytes)
        tensors = unpack(buf, specs)
        if t.device.type != "cpu":
            tensors = [x.detach().to(t.device).requires_grad_(x.requires_grad) for x in tensors]
        return tensors, is_tuple


@dataclass
class DistTransport:
    """One rank of a pipeline over a process group: one packed message per transfer.

    Lives as long as its Pipe: the per-stream capacities it learns carry over
    from step to step (see the comment above). ``finish`` ends a step.
    """

    group: dist.ProcessGroup | None
    device: torch.device
    stages: int
    timeout: float
    _sends: list = field(default_factory=list)
    _capacity: dict = field(default_factory=dict)
    _seen: dict = field(default_factory=dict)

    def peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def tag(self, key: Key) -> int:
        direction, stage, mb = key
        return ((mb * self.stages + stage) * 2 + (direction == "B")) * 2

    def _note(self, key: Key, nbytes: int) -> None:
        stream = key[:2]
        self._seen[stream] = max(self._seen.get(stream, 0), nbytes)

    def send(self, tensors: list[torch.Tensor], is_tuple: bool, dst: int, key: Key) -> None:
        tag, peer = self.tag(key), self.peer(dst)
        words = encode_header(tensors, is_tuple)
        self._note(key, words[0])
        if words[0] > self._capacity.get(key[:2], 0):
            notice = list(words)
            notice[1] = 1  # oversize: the full message follows on the next tag
            small = torch.tensor(notice, dtype=torch.int64).view(torch.uint8)
            self._sends.append((dist.isend(small, dst=peer, group=self.group, tag=tag), small))
            tag += 1
        buf = pack(tensors, words)
        self._sends.append((dist.isend(buf, dst=peer, group=self.group, tag=tag), buf))

    def recv(self, src: int, key: Key) -> _DistRecv:
        buf = torch.empty(_HEADER_BYTES + self._capacity.get(key[:2], 0), dtype=torch.uint8)
        work = dist.irecv(buf, src=self.peer(src), group=self.group, tag=self.tag(key))
        return _DistRecv(self, src, key, buf, work)

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            done = work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as err:  # gloo reports its timeout as a RuntimeError
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            raise TimeoutError(f"{what} not done within timeout={self.timeout} s") from err
        if not done:
            raise TimeoutError(f"{what} not done within timeout={self.timeout} s")

    def finish(self) -> None:
        """Waits for this step's sends, then grows the capacities for the next step.

        Both ends of a stream saw the same payloads this step, so they grow
        its capacity to the same value.
        """
        sends, self._sends = self._sends, []
        for work, _ in sends:
            self._wait(work, "send")
        for stream, nbytes in self._seen.items():
            self._capacity[stream] = max(self._capacity.get(stream, 0), nbytes)
        self._seen.clear()

    def fail(self, exc: BaseException) -> None:
        """Drops the failed step's sends and sizes; peers learn of it by their timeout."""
        self._sends.clear()
        self._seen.clear()
