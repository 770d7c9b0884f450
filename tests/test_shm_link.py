"""Same-host rings in shared memory: fastpipe._C.ShmLink, both ends in one process.

Each test maps a channel twice, once as its reader and once as its writer
(two ShmLink objects, as two processes would); threads stand in for the
processes where a call must wait for the other end (the C++ side releases
the GIL while it waits).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

from fastpipe._ext import native

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX shm on Linux")
OK, ABORTED, TIMEOUT = 0, 1, 2


@pytest.fixture(params=[0.0, 1e-3], ids=["sleep", "spin"])
def spin(request):
    return request.param


def _pair(spin: float, capacity: int, n: int = 1):
    """(reader link, [reader channels], writer link, [writer channels]) for n channels."""
    reader, writer = native().ShmLink(spin), native().ShmLink(spin)
    rch, wch = [], []
    for i in range(n):
        name = f"/fastpipe-test-{os.getpid()}-{time.monotonic_ns()}-{i}"
        rch.append(reader.open(name, True, False, capacity))
        wch.append(writer.open(name, False, True, 0))
        native().ShmLink.unlink(name)  # both mapped: the name can go
    return reader, rch, writer, wch


def _take(link, ch, timeout=5.0):
    status, tag, nbytes = link.next(ch, timeout)
    assert status == OK
    out = np.empty(nbytes, dtype=np.uint8)
    assert link.read(ch, out.ctypes.data, timeout) == OK
    return tag, out


def _message(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_messages_arrive_in_order_with_their_tags_and_bytes(spin):
    reader, (r,), writer, (w,) = _pair(spin, 4096)
    msgs = [(7, _message(100, 0)), (3, _message(0, 1)), (11, _message(13, 2)), (5, _message(1000, 3))]
    for tag, m in msgs:
        assert writer.send(w, tag, m.ctypes.data, m.size, 1.0) == OK
    for tag, m in msgs:
        got_tag, got = _take(reader, r)
        assert got_tag == tag and np.array_equal(got, m)


def test_a_message_larger_than_the_ring_streams_through_it(spin):
    """A 1 MB message through a 256-byte ring: the writer waits for room as the reader takes it."""
    reader, (r,), writer, (w,) = _pair(spin, 256)
    m = _message(1 << 20, 4)
    status = []
    t = threading.Thread(target=lambda: status.append(writer.send(w, 9, m.ctypes.data, m.size, 10.0)))
    t.start()
    tag, got = _take(reader, r, 10.0)
    t.join()
    assert status == [OK] and tag == 9 and np.array_equal(got, m)


def test_a_reader_waits_for_a_message_sent_later(spin):
    reader, (r,), writer, (w,) = _pair(spin, 4096)
    m = _message(64, 5)

    def late():
        time.sleep(0.05)
        writer.send(w, 1, m.ctypes.data, m.size, 1.0)

    t = threading.Thread(target=late)
    t.start()
    tag, got = _take(reader, r)
    t.join()
    assert tag == 1 and np.array_equal(got, m)


def test_a_wait_ends_at_its_timeout(spin):
    reader, (r,), writer, (w,) = _pair(spin, 128)
    start = time.monotonic()
    assert reader.next(r, 0.05)[0] == TIMEOUT
    m = _message(1000, 6)  # more than the ring holds, and nobody reads
    assert writer.send(w, 1, m.ctypes.data, m.size, 0.05) == TIMEOUT
    assert time.monotonic() - start < 2.0


def test_an_abort_wakes_the_peer_with_its_reason(spin):
    reader, (r,), writer, (w,) = _pair(spin, 4096)
    m = _message(8, 7)
    writer.send(w, 1, m.ctypes.data, m.size, 1.0)  # sent before the abort: still taken
    got = []
    t = threading.Thread(target=lambda: got.append(reader.next(r, 10.0)))
    tag, _ = _take(reader, r)
    assert tag == 1
    t.start()
    time.sleep(0.05)
    writer.abort("ValueError: boom")
    t.join(5.0)
    assert got and got[0][0] == ABORTED
    assert reader.peer_reason(r) == "ValueError: boom"
    # ... and the other way: a writer blocked on a full ring learns that its reader gave up.
    reader2, (r2,), writer2, (w2,) = _pair(spin, 128)
    big = _message(10_000, 8)
    status = []
    t = threading.Thread(target=lambda: status.append(writer2.send(w2, 2, big.ctypes.data, big.size, 10.0)))
    t.start()
    time.sleep(0.05)
    reader2.abort("KeyboardInterrupt: ")
    t.join(5.0)
    assert status == [ABORTED] and writer2.peer_reason(w2) == "KeyboardInterrupt: "


def test_two_ends_sending_each_other_more_than_a_ring_holds_both_finish():
    """Each end sends the other more than a ring holds, both at once, then
    takes what the other sent (a rank sending activations up while its
    neighbour sends gradients down). A send that waits for room takes in
    what its own incoming ring holds meanwhile, so neither end waits on the
    other forever."""
    a, b = native().ShmLink(0.0), native().ShmLink(0.0)
    chans = {}
    for src, dst, lsrc, ldst in (("a", "b", a, b), ("b", "a", b, a)):
        name = f"/fastpipe-test-{os.getpid()}-{time.monotonic_ns()}-{src}{dst}"
        chans[dst + "_reads"] = ldst.open(name, True, False, 256)
        chans[src + "_writes"] = lsrc.open(name, False, True, 0)
        native().ShmLink.unlink(name)
    msgs = {"a": _message(50_000, 9), "b": _message(70_000, 10)}
    status, got = {}, {}

    def rank(me, link, tag):
        m = msgs[me]
        status[me] = link.send(chans[me + "_writes"], tag, m.ctypes.data, m.size, 10.0)
        got[me] = _take(link, chans[me + "_reads"], 10.0)

    threads = [threading.Thread(target=rank, args=("a", a, 1)), threading.Thread(target=rank, args=("b", b, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20.0)
    assert status == {"a": OK, "b": OK}
    assert got["b"][0] == 1 and np.array_equal(got["b"][1], msgs["a"])
    assert got["a"][0] == 2 and np.array_equal(got["a"][1], msgs["b"])
    assert a.staged == 0 and b.staged == 0


def test_a_reader_waiting_on_one_ring_takes_in_the_others():
    """A reader waiting for one peer stages what another peer sends, so that
    peer's send finishes even when its message is larger than the ring; the
    staged message is then returned first, whole."""
    reader, (r1, r2), writer, (w1, w2) = _pair(0.0, 256, n=2)
    big = _message(20_000, 11)
    status = []
    t = threading.Thread(target=lambda: status.append(writer.send(w2, 5, big.ctypes.data, big.size, 10.0)))
    t.start()
    assert reader.next(r1, 0.3)[0] == TIMEOUT  # nothing on ring 1; ring 2's message comes in
    t.join(10.0)
    assert status == [OK] and reader.staged == 1
    tag, got = _take(reader, r2)
    assert tag == 5 and np.array_equal(got, big) and reader.staged == 0


def test_opening_checks_its_arguments():
    link = native().ShmLink(0.0)
    with pytest.raises(ValueError, match="capacity"):
        link.open(f"/fastpipe-test-{os.getpid()}-cap", True, False, 100)  # not a multiple of 8
    with pytest.raises(FileNotFoundError):
        link.open(f"/fastpipe-test-{os.getpid()}-missing", False, True, 0)
    reader, (r,), writer, (w,) = _pair(0.0, 4096)
    with pytest.raises(ValueError, match="is read"):
        reader.send(r, 1, 0, 0, 1.0)
    with pytest.raises(IndexError):
        reader.next(5, 1.0)


def test_a_ring_larger_than_dev_shm_fails_when_it_is_made_and_leaves_no_name():
    """Its pages are reserved at once: too little room is an OSError now (the
    Pipe then falls back to gloo), not a SIGBUS at the first write past it."""
    st = os.statvfs("/dev/shm")
    size = st.f_blocks * st.f_frsize
    if size == 0:
        pytest.skip("/dev/shm has no size limit")
    name = f"/fastpipe-test-{os.getpid()}-huge"
    with pytest.raises(OSError):
        native().ShmLink(0.0).open(name, True, False, size + (1 << 20))
    assert not os.path.exists("/dev/shm" + name)
