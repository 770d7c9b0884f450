"""The hand-off point of local pipelines: fastpipe._C.Mailbox and its Python face."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from fastpipe._ext import native
from fastpipe.runtime.transport import Mailbox, PeerError


@pytest.fixture(params=[0.0, 1e-3], ids=["sleep", "spin"])
def box(request):
    return Mailbox(2, spin=request.param)


def test_a_put_before_the_take_is_found_at_once(box):
    payload = ([1, 2], "spec")
    box.put(("F", 1, 0), payload)
    assert box.take(("F", 1, 0), 1.0) is payload


def test_keys_do_not_mix(box):
    for key in [("F", 1, 0), ("B", 1, 0), ("F", 2, 0), ("F", 1, 1)]:
        box.put(key, key)
    for key in [("F", 1, 1), ("B", 1, 0), ("F", 1, 0), ("F", 2, 0)]:
        assert box.take(key, 1.0) == key


def test_a_take_waits_for_the_put_of_another_thread(box):
    got = []

    def receiver():
        got.append(box.take(("B", 0, 3), 5.0))

    t = threading.Thread(target=receiver)
    t.start()
    time.sleep(0.05)  # the receiver is waiting now (past its spin)
    assert t.is_alive()
    box.put(("F", 0, 3), "other key")  # wakes it, but not for its key
    time.sleep(0.01)
    assert t.is_alive()
    box.put(("B", 0, 3), "mine")
    t.join(5)
    assert got == ["mine"]
    assert box.take(("F", 0, 3), 1.0) == "other key"


def test_a_waiting_take_lets_other_threads_run_python():
    box = Mailbox(2, spin=0.2)  # spins for the whole wait below
    counted = []

    def receiver():
        box.take(("F", 1, 0), 5.0)

    t = threading.Thread(target=receiver)
    t.start()
    deadline, n = time.perf_counter() + 0.1, 0
    while time.perf_counter() < deadline:
        n += 1  # would stall if the spinning receiver held the GIL
    counted.append(n)
    box.put(("F", 1, 0), None)
    t.join(5)
    assert counted[0] > 1000


def test_timeout_names_the_message(box):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="gradients of stage 2, microbatch 5 within timeout=0.05"):
        box.take(("B", 2, 5), 0.05)
    assert 0.04 < time.monotonic() - t0 < 2.0


def test_fail_wakes_a_waiting_take_with_the_first_failure(box):
    errors = []

    def receiver():
        try:
            box.take(("F", 1, 0), 10.0)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    t = threading.Thread(target=receiver)
    t.start()
    time.sleep(0.05)
    first = ValueError("boom")
    box.fail(0, first)
    box.fail(1, RuntimeError("later"))
    t.join(5)
    assert not t.is_alive()
    assert isinstance(errors[0], PeerError) and "pipeline rank 0 failed" in str(errors[0])
    assert errors[0].__cause__ is first
    assert box.first_failure == (0, first)


def test_after_a_failure_present_messages_are_still_delivered(box):
    box.put(("F", 1, 0), "here")
    box.fail(0, ValueError("boom"))
    assert box.take(("F", 1, 0), 1.0) == "here"
    with pytest.raises(PeerError):
        box.take(("F", 1, 1), 1.0)


def test_payloads_are_referenced_until_taken_and_freed_with_the_box():
    payload = object()
    base = sys.getrefcount(payload)
    box = native().Mailbox(0.0)
    box.put(7, payload)
    assert sys.getrefcount(payload) == base + 1 and len(box) == 1
    status, got = box.take(7, 1.0)
    assert status == 0 and got is payload
    del got
    assert sys.getrefcount(payload) == base and len(box) == 0
    box.put(8, payload)
    box.put(8, payload)  # a second put of a key replaces the first
    assert sys.getrefcount(payload) == base + 1
    del box
    assert sys.getrefcount(payload) == base


def test_native_answers_are_status_codes():
    box = native().Mailbox(0.0)
    assert box.take(1, 0.01) == (2, None)
    box.fail()
    assert box.failed and box.take(1, 1.0) == (1, None)


def test_spin_default_follows_the_cores(monkeypatch):
    import fastpipe.runtime.transport.local as local

    monkeypatch.setattr(local.os, "cpu_count", lambda: 2)
    assert Mailbox(2)._native.spin == pytest.approx(1e-3)
    assert Mailbox(4)._native.spin == 0.0  # more ranks than cores: a spinner takes a core


def test_bad_spin_is_refused():
    with pytest.raises(ValueError, match="spin must be >= 0 seconds, got -1"):
        Mailbox(2, spin=-1)


def test_many_threads_hand_over_in_order():
    """A chain of threads, each passing every message on: nothing is lost."""
    box, n, hops = Mailbox(4, spin=1e-4), 200, 4

    def hop(h):
        for i in range(n):
            box.put(("F", h + 1, i), box.take(("F", h, i), 10.0) + 1)

    threads = [threading.Thread(target=hop, args=(h,)) for h in range(hops)]
    for t in threads:
        t.start()
    for i in range(n):
        box.put(("F", 0, i), i)
    got = [box.take(("F", hops, i), 10.0) for i in range(n)]
    for t in threads:
        t.join(10)
    assert got == [i + hops for i in range(n)]
