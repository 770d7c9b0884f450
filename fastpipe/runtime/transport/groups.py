"""The process groups a distributed pipeline's messages travel on, and their first connection.

Messages up the ranks (to a higher rank) and down travel on two process
groups of their own (:func:`flow_groups`), so a pair's gloo socket, or its
NCCL stream, carries one way only; the full message after an oversize notice
takes two more when messages are exact (:func:`late_groups`); and where they
are (NCCL), every pair is connected once, in one total order, when the Pipe
is built (:func:`connect_pairs`). Why each: ``docs/design/transports.md``, "Process
groups" and "NCCL's rules".
"""

from __future__ import annotations

import atexit
import ctypes
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["all_reduce", "broadcast", "connect_pairs", "finish", "flow_groups", "late_groups", "started"]

_FLOW_GROUPS: dict = {}  # parent group -> {"up": group, "down": group}
_LATE_GROUPS: dict = {}  # parent group -> {"up": group, "down": group}


_IN_FLIGHT: list = []  # works of collectives left in flight (``started``)
_DONE: list = []  # works of collectives waited for, kept a while (``finish``)
_KEEP_DONE = 8
_EXIT_WAIT = timedelta(seconds=10)


@atexit.register
def _forget_groups() -> None:
    """Drops the cached groups while the interpreter is whole, and finishes
    the collectives still in flight.

    A collective's work must not be freed by a gloo worker thread once
    finalization has begun: freeing it releases Python tensors, which takes
    the GIL, and a thread that asks for the GIL then is ended, aborting the
    process ("terminate called without an active exception"). The worker
    drops its reference shortly after the work completes, with nothing to
    say when; so the works kept here are never released (a few small objects,
    leaked as the process ends), and whatever the worker frees is not the last
    reference. The caches would keep even a world the user destroyed alive."""
    for work in _IN_FLIGHT:
        try:
            work.wait(_EXIT_WAIT)
        except Exception:  # a peer gone: nothing is waiting for the result
            pass
    for work in (*_IN_FLIGHT, *_DONE):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))
    _IN_FLIGHT.clear()
    _DONE.clear()
    _FLOW_GROUPS.clear()
    _LATE_GROUPS.clear()


def started(work):
    """Registers the ``Work`` of a collective left in flight (``async_op=True``)
    and returns it: ``finish`` it later; one still in flight when the process
    exits is waited for then (a step's last loss broadcast, when the script
    ends right after the step)."""
    _IN_FLIGHT.append(work)
    return work


def finish(work, timeout: float | None = None) -> None:
    """Waits for a collective's ``Work`` (at most ``timeout`` seconds where
    given, else the group's own timeout) and holds it until a few
    collectives later (or exit): every collective fastpipe waits for ends here.

    Right after a gloo collective completes, the backend's worker thread
    still holds the work; were its reference the last, that thread would
    free the work's Python tensors, taking the GIL to do it, and a process
    that reached finalization in the meantime (a script's last step or
    ``clip_grad_norm_``, then exit) aborts with "terminate called without an
    active exception". Kept here, the last reference is dropped on a Python
    thread."""
    try:
        work.wait() if timeout is None else work.wait(timedelta(seconds=timeout))
    finally:
        for i, w in enumerate(_IN_FLIGHT):
            if w is work:
                del _IN_FLIGHT[i]
                break
        _DONE.append(work)
        if len(_DONE) > _KEEP_DONE:
            del _DONE[0]


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
               timeout: float | None = None) -> None:
    """``dist.all_reduce`` as a blocking call, its work freed by this thread (``finish``)."""
    finish(dist.all_reduce(tensor, op=op, group=group, async_op=True), timeout)


def broadcast(tensor: torch.Tensor, src: int, group=None) -> None:
    """``dist.broadcast`` as a blocking call, its work freed by this thread (``finish``)."""
    finish(dist.broadcast(tensor, src=src, group=group, async_op=True))


def flow_groups(group: dist.ProcessGroup | None) -> dict[str, dist.ProcessGroup]:
    """Two process groups over ``group``'s ranks, on its backend: "up" carries
    messages to a higher rank, "down" to a lower one (why: ``docs/design/transports.md``).

    Collective over the ranks of ``group`` (only they take part), so every
    rank must call it in the same order, as it builds its Pipe. The groups
    are made once per parent group and shared by every Pipe over it (steps
    of two Pipes never run at once in one process); they live until
    ``destroy_process_group()``, after which the next call forgets them.
    """
    parent = group if group is not None else dist.group.WORLD
    return _groups_over(_FLOW_GROUPS, group, ("up", "down"), dist.get_backend(parent))


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
