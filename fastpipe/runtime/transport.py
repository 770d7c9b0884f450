"""Moving stage values between pipeline ranks: in one process, or over torch.distributed.

Both transports take the same verbs, so the executor has one code path:

    send(tensors, is_tuple, dst, key)   non-blocking; the tensors must not be
                                        modified afterwards
    recv(src, key) -> Pending           posts the receive; Pending.wait()
                                        returns (tensors, is_tuple)
    finish()                            waits for outstanding sends
    fail(exc)                           tells every peer this rank failed

``key`` is ``(direction, stage, microbatch)``: ``"F"`` for activations going
to ``stage``, ``"B"`` for gradients going to ``stage``. Keys make matching
independent of the order in which two ranks issue their operations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

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

    def reset(self) -> None:
        with self._cond:
            self._slots.clear()
            self._failed = None


def _describe(key: Key) -> str:
    what = "activations" if key[0] == "F" else "gradients"
    return f"{what} of stage {key[1]}, microbatch {key[2]}"


@dataclass
class _Ready:
    payload: Payload

    def wait(self) -> Payload:
        return self.payload


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
        moved = [_mark(t.detach().to(device, non_blocking=True), t) for t in tensors]
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

_HEADER = 64  # int64 slots: [is_tuple, n, (dtype, requires_grad, ndim, *shape) per tensor]
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


def encode_header(tensors: Sequence[torch.Tensor], is_tuple: bool) -> torch.Tensor:
    """Describes a payload in a fixed-size int64 tensor (shapes, dtypes, count)."""
    words = [int(is_tuple), len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages")
        words += [_CODE[t.dtype], int(needs_grad(t)), t.dim(), *t.shape]
    if len(words) > _HEADER:
        raise ValueError(
            f"stage value too complex to describe: {len(tensors)} tensors need {len(words)} "
            f"header words, at most {_HEADER}"
        )
    return torch.tensor(words + [0] * (_HEADER - len(words)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[bool, list[tuple[torch.dtype, bool, list[int]]]]:
    """Inverse of ``encode_header``: (is_tuple, [(dtype, requires_grad, shape)])."""
    words = header.tolist()
    is_tuple, n, pos, specs = bool(words[0]), words[1], 2, []
    for _ in range(n):
        dtype, grad, ndim = _DTYPES[words[pos]], bool(words[pos + 1]), words[pos + 2]
        specs.append((dtype, grad, words[pos + 3 : pos + 3 + ndim]))
        pos += 3 + ndim
    return is_tuple, specs


@dataclass
class _DistRecv:
    transport: DistTransport
    src: int
    tag: int
    header: torch.Tensor
    work: dist.Work

    def wait(self) -> Payload:
        t = self.transport
        t._wait(self.work, f"header from rank {self.src}")
        is_tuple, specs = decode_header(self.header)
        tensors = [torch.empty(shape, dtype=dtype, device=t.device) for dtype, _, shape in specs]
        works = [
            dist.irecv(x, src=t.peer(self.src), group=t.group, tag=self.tag + 1 + i)
            for i, x in enumerate(tensors)
        ]
        for w in works:
            t._wait(w, f"payload from rank {self.src}")
        return [x.requires_grad_(g) for x, (_, g, _) in zip(tensors, specs)], is_tuple


@dataclass
class DistTransport:
    """One rank of a pipeline over a process group: isend/irecv with a header.

    Every message is a fixed-size header followed by its tensors, each on its
    own tag, so the receiver learns shapes from the header and a later step
    with other shapes (another sequence length) needs nothing special.
    """

    group: dist.ProcessGroup | None
    device: torch.device
    stages: int
    timeout: float
    _sends: list = field(default_factory=list)

    def peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def tag(self, key: Key) -> int:
        direction, stage, mb = key
        return ((mb * self.stages + stage) * 2 + (direction == "B")) * (_HEADER + 1)

    def send(self, tensors: list[torch.Tensor], is_tuple: bool, dst: int, key: Key) -> None:
        tag, peer = self.tag(key), self.peer(dst)
        header = encode_header(tensors, is_tuple)
        self._sends.append((dist.isend(header, dst=peer, group=self.group, tag=tag), header))
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()
            self._sends.append((dist.isend(t, dst=peer, group=self.group, tag=tag + 1 + i), t))

    def recv(self, src: int, key: Key) -> _DistRecv:
        tag = self.tag(key)
        header = torch.empty(_HEADER, dtype=torch.int64)
        work = dist.irecv(header, src=self.peer(src), group=self.group, tag=tag)
        return _DistRecv(self, src, tag, header, work)

    def _wait(self, work: dist.Work, what: str) -> None:
        from datetime import timedelta

        if not work.wait(timedelta(seconds=self.timeout)):
            raise TimeoutError(f"{what} not done within timeout={self.timeout} s")

    def finish(self) -> None:
        sends, self._sends = self._sends, []
        for work, _ in sends:
            self._wait(work, "send")

    def fail(self, exc: BaseException) -> None:
        pass  # peers learn of it by timeout; the reliability work makes this prompt
