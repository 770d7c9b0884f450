"""A failing distributed rank: abort notices to its peers, then the step drained.

A rank whose stage raised still owes its peers messages they are waiting
for. Rather than let each wait out its timeout, the rank sends an abort
notice (``wire``: [length | ABORT][reason]) in place of every message it
owed, so a peer fails at once with a PeerError naming it and passes the
news on the same way. It then takes in what its peers still send this step
and waits for its own sends, so no thread is left inside a gloo wait and no
message is left in gloo's queue when the error reaches the caller.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fastpipe.runtime.transport.base import Key, PeerError
from fastpipe.runtime.transport.wire import (
    ABORT, MIN_POST, OVERSIZE, PREFIX, control_message, host_bytes,
)

if TYPE_CHECKING:
    from fastpipe.runtime.transport.dist import DistTransport

__all__ = ["fail_step", "wait_until"]


def fail_step(t: DistTransport, exc: BaseException, unsent: Iterable[tuple[Key, int]]) -> None:
    """``DistTransport.fail``: tells the peers, drops the step's state and frees every buffer slot.

    Notices wait at most a few seconds (``min(timeout, 10)``) to be taken.
    """
    for _, rings in t._recv_rings.values():  # no more receives get posted
        for ring in rings.values():
            ring.cancel(f"the step failed: {exc!r}")
    notices = _send_notices(t, exc, unsent)
    # Take in what the peers still send this step (their data, or their
    # own notices once they fail too), so their sends complete and so do
    # the receives our lanes posted: no thread is left inside a gloo wait
    # when the error reaches the caller.
    deadline = time.monotonic() + min(t.timeout, 10.0)
    for key, src, work, buf in _drain(t):
        _finish_drain(t, key, src, work, buf, deadline)
    # The notices, and the data sends issued before the failure, must
    # leave before this process may exit: an isend not waited for can
    # still sit in gloo's queue when the caller tears the process group
    # down, and the peer then sees a closed connection ("rank N is gone")
    # instead of the reason (1 run in ~20 of the fault tests did for the
    # notices; with them waited for, a peer still waiting for a message
    # sent just before the failure saw the same under a loaded machine).
    issued = [work for item in t._sends if isinstance(item, list) for work, *_ in item]
    for work in issued + [work for work, _msg in notices]:
        if not wait_until(work, deadline):
            break  # past the deadline, or the peer is gone: it needs no notice
    for event in t._events:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            event.wait(left)
        except BaseException:  # noqa: BLE001 - the lanes' own failures are expected here
            pass
    t._events = []
    t._sends = []
    t._seen.clear()
    for ring in t._send_rings.values():
        ring.cancel(f"the step failed: {exc!r}")


def _send_notices(t: DistTransport, exc: BaseException, unsent: Iterable[tuple[Key, int]]) -> list:
    """An abort notice on every message of the step this rank still owed: [(work, message)]."""
    if not isinstance(exc, PeerError):  # a peer's failure is passed on as ours
        reason = f"{type(exc).__name__}: {exc}"
    else:
        reason = str(exc)
    payload = reason.encode("utf-8")[: MIN_POST - PREFIX]
    notices = []
    for key, dst in unsent:
        size = t._posted_size(key[:2]) if t.exact else 0
        msg = control_message(PREFIX + len(payload), ABORT, payload, size, t.buffers)
        try:
            work = dist.isend(msg, dst=t.peer(dst), group=t._group(key), tag=t.tag(key))
            notices.append((work, msg))
        except RuntimeError:
            break  # the connection is gone already
    return notices


def _drain(t: DistTransport) -> list:
    """Posts a receive for every message of the step not yet posted.

    Exact: per peer, the receives it already has in flight and then the
    rest, in its send order (matching is by order)."""
    out, todo = [], []
    if t.exact:
        for src, order in t._order.items():
            out += [(key, src, posted.work, posted.buf) for key, posted in t._inflight[src]]
            t._inflight[src].clear()
            todo += [(key, src) for key in order]
            order.clear()
    else:
        todo = [(key, src) for key, src in t._expected if key not in t._posted]
    for key, src in todo:
        buf = torch.empty(t._posted_size(key[:2]), dtype=torch.uint8, device=t.buffers)
        try:
            work = dist.irecv(buf, src=t.peer(src), group=t._group(key), tag=t.tag(key))
        except RuntimeError:
            break  # the connection is gone
        out.append((key, src, work, buf))
    return out


def _finish_drain(t: DistTransport, key: Key, src: int, work: dist.Work, buf: torch.Tensor,
                  deadline: float) -> None:
    """Waits (until ``deadline``) for a drained message; follows an oversize notice.

    gloo only learns that a receive completed inside ``wait`` (its
    ``is_completed`` stays False until then), and a wait that times out
    closes the connection: acceptable here, the step has failed anyway.
    """
    try:
        if not wait_until(work, deadline):
            return
        total, flags = host_bytes(buf, PREFIX)[:PREFIX].view(torch.int64).tolist()
        if flags & OVERSIZE:
            full = torch.empty(total, dtype=torch.uint8, device=t.buffers)
            rest = t._irecv_late(full, src, key)
            wait_until(rest, deadline)
    except RuntimeError:
        pass  # the peer is gone: nothing left to take in


def wait_until(work: dist.Work, deadline: float) -> bool:
    """Waits for ``work`` until ``deadline`` (``time.monotonic()``); False when it did not end."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    try:
        return bool(work.wait(timedelta(seconds=left)))
    except RuntimeError:
        return False
