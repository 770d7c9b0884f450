"""Lowering: insert the sends and receives a compute-only schedule implies."""

from __future__ import annotations

import dataclasses

from fastpipe.schedules._ir import Action, Kind, Schedule

__all__ = ["lower", "matching_recv", "matching_send"]


def lower(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with SEND/RECV actions around each cross-rank transfer.

    For every compute action on rank ``r``:

    * ``F`` of stage ``s``: ``RECV_F(s)`` right before it if stage ``s - 1`` is
      on another rank, ``SEND_F(s)`` right after it if stage ``s + 1`` is.
    * ``B`` or ``I`` of stage ``s``: ``RECV_B(s)`` right before it if stage
      ``s + 1`` is on another rank, ``SEND_B(s)`` right after it if stage
      ``s - 1`` is.
    * ``W`` needs nothing.

    Transfers between stages on the same rank need no action. A receive sits
    right before the compute that needs it; an executor may post it earlier.
    Sends are meant to be non-blocking (isend): the validator's deadlock check
    assumes that a send never waits for its receive.

    Args:
        schedule: A compute-only schedule. One that already holds
            communication actions is returned unchanged (as a copy), so
            ``lower(lower(s)) == lower(s)``.

    Returns:
        A new schedule with the same name, sizes and placement.

    Example:
        >>> from fastpipe.schedules import build
        >>> [str(a) for a in lower(build("gpipe", 2, 1)).actions[0]]
        ['0F0', '0SEND_F0', '0RECV_B0', '0B0']
    """
    if schedule.is_lowered:
        return dataclasses.replace(schedule, actions=[list(a) for a in schedule.actions])
    place = schedule.stage_to_rank
    last = schedule.stages - 1
    lowered = []
    for rank, row in enumerate(schedule.actions):
        out: list[Action] = []
        for action in row:
            s, j = action.stage, action.microbatch
            if action.kind is Kind.F:
                if s > 0 and place[s - 1] != rank:
                    out.append(Action(s, Kind.RECV_F, j))
                out.append(action)
                if s < last and place[s + 1] != rank:
                    out.append(Action(s, Kind.SEND_F, j))
            elif action.kind.is_backward:
                if s < last and place[s + 1] != rank:
                    out.append(Action(s, Kind.RECV_B, j))
                out.append(action)
                if s > 0 and place[s - 1] != rank:
                    out.append(Action(s, Kind.SEND_B, j))
            else:
                out.append(action)
        lowered.append(out)
    return dataclasses.replace(schedule, actions=lowered)


def matching_recv(send: Action) -> Action:
    """The receive that pairs with ``send``.

    ``0SEND_F1`` pairs with ``1RECV_F1``, ``1SEND_B1`` with ``0RECV_B1``.

    Raises:
        ValueError: If ``send`` is not a SEND_F or SEND_B action.
    """
    if send.kind is Kind.SEND_F:
        return Action(send.stage + 1, Kind.RECV_F, send.microbatch)
    if send.kind is Kind.SEND_B:
        return Action(send.stage - 1, Kind.RECV_B, send.microbatch)
    raise ValueError(f"{send} is not a send action")


def matching_send(recv: Action) -> Action:
    """The send that pairs with ``recv``, the reverse of :func:`matching_recv`.

    Raises:
        ValueError: If ``recv`` is not a RECV_F or RECV_B action.
    """
    if recv.kind is Kind.RECV_F:
        return Action(recv.stage - 1, Kind.SEND_F, recv.microbatch)
    if recv.kind is Kind.RECV_B:
        return Action(recv.stage + 1, Kind.SEND_B, recv.microbatch)
    raise ValueError(f"{recv} is not a receive action")
