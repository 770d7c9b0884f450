"""Lowering: the sends and receives a compute-only schedule implies."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpipe.schedules import Action, Kind, build, lower, names
from fastpipe.schedules._lower import matching_recv, matching_send


def _strs(row: list[Action]) -> list[str]:
    return [str(a) for a in row]


def test_gpipe_two_ranks_exact() -> None:
    lowered = lower(build("gpipe", 2, 2))
    assert _strs(lowered.actions[0]) == [
        "0F0",
        "0SEND_F0",
        "0F1",
        "0SEND_F1",
        "0RECV_B0",
        "0B0",
        "0RECV_B1",
        "0B1",
    ]
    assert _strs(lowered.actions[1]) == [
        "1RECV_F0",
        "1F0",
        "1RECV_F1",
        "1F1",
        "1B0",
        "1SEND_B0",
        "1B1",
        "1SEND_B1",
    ]
    assert lowered.is_lowered and not build("gpipe", 2, 2).is_lowered


def test_same_rank_transfers_need_no_comm() -> None:
    # V placement: stages 3 and 4 share rank 3, so nothing goes between them.
    lowered = lower(build("zbv", 4, 4))
    comm = [a for row in lowered.actions for a in row if not a.kind.is_compute]
    assert not any(a.stage == 3 and a.kind in (Kind.SEND_F, Kind.RECV_B) for a in comm)
    assert not any(a.stage == 4 and a.kind in (Kind.RECV_F, Kind.SEND_B) for a in comm)
    # One rank holds every stage: no communication at all.
    assert not lower(build("interleaved-1f1b", 1, 3, 3)).is_lowered


def test_lower_is_idempotent_and_keeps_metadata() -> None:
    schedule = build("interleaved-1f1b", 3, 5, 2)
    once = lower(schedule)
    assert lower(once) == once and once == schedule.lowered()
    assert (once.name, once.ranks, once.stages, once.microbatches, once.stage_to_rank) == (
        schedule.name,
        3,
        6,
        5,
        schedule.stage_to_rank,
    )


def test_matching_pairs() -> None:
    assert matching_recv(Action(0, Kind.SEND_F, 1)) == Action(1, Kind.RECV_F, 1)
    assert matching_recv(Action(1, Kind.SEND_B, 1)) == Action(0, Kind.RECV_B, 1)
    assert matching_send(Action(1, Kind.RECV_F, 2)) == Action(0, Kind.SEND_F, 2)
    assert matching_send(Action(0, Kind.RECV_B, 2)) == Action(1, Kind.SEND_B, 2)
    with pytest.raises(ValueError, match="1F0 is not a send action"):
        matching_recv(Action(1, Kind.F, 0))
    with pytest.raises(ValueError, match="is not a receive action"):
        matching_send(Action(1, Kind.SEND_F, 0))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(names()), st.integers(1, 6), st.integers(1, 12))
def test_lowering_invariants(name: str, ranks: int, microbatches: int) -> None:
    schedule = build(name, ranks, microbatches)
    lowered = lower(schedule)
    place = schedule.stage_to_rank
    sends = Counter()
    recvs = Counter()
    for rank, (row, low) in enumerate(zip(schedule.actions, lowered.actions)):
        assert [a for a in low if a.kind.is_compute] == row  # compute order untouched
        for i, a in enumerate(low):
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                nxt = low[i + 1]  # a receive sits right before what needs it
                assert (nxt.stage, nxt.microbatch) == (a.stage, a.microbatch)
                assert nxt.kind is Kind.F if a.kind is Kind.RECV_F else nxt.kind.is_backward
                recvs[a] += 1
            elif a.kind in (Kind.SEND_F, Kind.SEND_B):
                prev = low[i - 1]  # a send sits right after what produced it
                assert (prev.stage, prev.microbatch) == (a.stage, a.microbatch)
                peer = matching_recv(a)
                assert place[peer.stage] != rank
                sends[peer] += 1
    assert sends == recvs and set(sends.values()) <= {1}
    cross = sum(place[s] != place[s + 1] for s in range(schedule.stages - 1))
    assert sum(sends.values()) == 2 * cross * microbatches
