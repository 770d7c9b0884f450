"""The buffer ring: native SlotRing bookkeeping, BufferRing, and the slot plan."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from fastpipe.runtime import HostRing, SlotRing
from fastpipe.runtime.buffers import BufferRing, receive_slots
from fastpipe.schedules import build, lower, names


def test_slots_go_round_robin_when_released_in_order():
    ring = SlotRing(3)
    order = []
    for _ in range(9):
        slot = ring.acquire(1)
        order.append(slot)
        ring.release(slot)
    assert order == [0, 1, 2] * 3
    assert ring.size == 3 and ring.held == 0 and ring.acquisitions == 9


def test_no_slot_is_reused_while_in_flight():
    """Stress: random-length uses on several lanes, fences released at once."""
    rng = random.Random(0)
    ring, lanes = SlotRing(3), HostRing(3)
    busy = [False] * 3
    bad: list[int] = []
    try:
        for _ in range(1500):
            slot = ring.acquire(10)
            if busy[slot]:
                bad.append(slot)
            busy[slot] = True
            delay = rng.random() * 1e-3

            def use(slot=slot, delay=delay):
                time.sleep(delay)
                busy[slot] = False

            fence = lanes.submit(rng.randrange(3), use)
            ring.release(slot, fence)  # handed back now; reusable only after `use`
    finally:
        lanes.close()
    assert bad == []
    assert ring.size == 3  # a bounded ring never grows


def test_growable_ring_adds_a_slot_instead_of_waiting():
    lanes = HostRing(1)
    gate = threading.Event()
    try:
        ring = SlotRing(1, growable=True)
        slot = ring.acquire()
        fence = lanes.submit(0, gate.wait)
        ring.release(slot, fence)
        assert ring.acquire() == 1  # slot 0's fence is not done
        gate.set()
        fence.wait(5)
        assert ring.acquire() == 0  # now it is
        assert ring.size == 2
    finally:
        gate.set()
        lanes.close()


def test_bounded_ring_times_out_naming_the_slots():
    ring = SlotRing(2)
    ring.acquire()
    ring.acquire()
    with pytest.raises(TimeoutError, match="all 2 slots in use"):
        ring.acquire(0.05)


def test_cancel_wakes_a_waiter():
    ring = SlotRing(1)
    ring.acquire()
    errors: list[BaseException] = []

    def wait():
        try:
            ring.acquire(10)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    ring.cancel("step failed")
    t.join(5)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "step failed" in str(errors[0])
    assert ring.held == 0 and ring.acquire(1) == 0  # usable again


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="got 0"):
        SlotRing(0)
    ring = SlotRing(2)
    with pytest.raises(IndexError, match="slot 5"):
        ring.release(5)
    with pytest.raises(ValueError, match="released twice"):
        ring.release(1)
    with pytest.raises(ValueError, match="-1"):
        ring.acquire(-1)


def test_buffer_ring_reuses_buffers():
    ring = BufferRing(2, torch.device("cpu"), growable=False, timeout=1)
    views = []
    for n in (64, 64, 32, 64):
        slot, view = ring.get(n)
        assert view.numel() == n and view.dtype == torch.uint8
        views.append(view.data_ptr())
        ring.put(slot)
    assert ring.allocations == 2  # one per slot; smaller requests reuse them
    assert views[0] == views[2] and views[1] == views[3]
    slot, view = ring.get(128)  # larger than slot 0: enlarged once
    assert ring.allocations == 3


@pytest.mark.parametrize("schedule", names())
def test_slot_plan_covers_every_receive(schedule):
    spr = 2 if schedule in ("interleaved-1f1b", "looped-bfs", "zbv", "dualpipev") else None
    kwargs = {} if spr is None else {"stages_per_rank": spr}
    lowered = lower(build(schedule, 2, 6, **kwargs))
    for actions in lowered.actions:
        plan = receive_slots(actions)
        streams = {("F" if a.kind.name == "RECV_F" else "B", a.stage)
                   for a in actions if a.kind.name.startswith("RECV")}
        assert set(plan) == streams
        assert all(2 <= n <= 6 + 1 for n in plan.values())
        ahead = receive_slots(actions, lookahead=1)
        assert set(ahead) == streams and all(2 <= n <= 6 + 1 for n in ahead.values())


def test_slot_plan_is_the_peak_held_plus_lookahead():
    lowered = lower(build("1f1b", 2, 8))
    # rank 1 receives activations; each is held from its RECV_F to its B,
    # and 1F1B on the last rank runs F, B, F, B...: one held at a time.
    assert receive_slots(lowered.actions[1], lookahead=1) == {("F", 1): 2}
    assert receive_slots(lowered.actions[1], lookahead=0) == {("F", 1): 1}
    # GPipe holds every microbatch's activations until the backward phase.
    assert receive_slots(lower(build("gpipe", 2, 8)).actions[1], lookahead=1) == {("F", 1): 9}


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "interleaved-1f1b"])
def test_default_slot_plan_posts_every_receive_at_once(schedule):
    spr = 2 if schedule in ("interleaved-1f1b", "zbv") else None
    kwargs = {} if spr is None else {"stages_per_rank": spr}
    lowered = lower(build(schedule, 2, 8, **kwargs))
    for actions in lowered.actions:
        counts: dict = {}
        for a in actions:
            if a.kind.name.startswith("RECV"):
                stream = ("F" if a.kind.name == "RECV_F" else "B", a.stage)
                counts[stream] = counts.get(stream, 0) + 1
        assert receive_slots(actions) == counts
        assert all(n == 8 for n in counts.values())  # one per microbatch
