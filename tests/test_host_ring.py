"""The host backend of the lane ring: fastpipe._C.HostRing and Event."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from fastpipe.runtime import Event, HostRing


@pytest.fixture
def ring():
    r = HostRing(4)
    yield r
    r.close()


def test_results_are_returned(ring):
    assert ring.submit(0, lambda: 6 * 7).wait(5) == 42


def test_fifo_order_within_a_lane(ring):
    seen: list[int] = []
    events = [ring.submit(1, lambda i=i: seen.append(i)) for i in range(200)]
    events[-1].wait(5)
    assert seen == list(range(200))


def test_cross_lane_dependency_orders_work(ring):
    seen: list[str] = []
    first = ring.submit(0, lambda: (time.sleep(0.05), seen.append("producer")))
    second = ring.submit(1, lambda: seen.append("consumer"), [first])
    second.wait(5)
    assert seen == ["producer", "consumer"]


def test_lanes_run_concurrently(ring):
    # Two tasks that each wait for the other's signal finish only if the lanes
    # are really separate threads.
    a, b = threading.Event(), threading.Event()
    ea = ring.submit(0, lambda: (a.set(), b.wait(5))[1])
    eb = ring.submit(1, lambda: (b.set(), a.wait(5))[1])
    assert ea.wait(5) is True and eb.wait(5) is True


def test_exception_keeps_type_and_message(ring):
    class StageError(Exception):
        pass

    def boom():
        raise StageError("stage 3 exploded on microbatch 7")

    ev = ring.submit(2, boom)
    with pytest.raises(StageError, match="stage 3 exploded on microbatch 7"):
        ev.wait(5)
    assert ev.done() and ev.failed()
    # Every waiter sees the same error, not a consumed one.
    with pytest.raises(StageError):
        ev.wait(5)


def test_failed_dependency_propagates_root_cause(ring):
    ran: list[bool] = []

    def boom():
        raise KeyError("missing activation")

    bad = ring.submit(0, boom)
    dependent = ring.submit(1, lambda: ran.append(True), [bad])
    with pytest.raises(KeyError, match="missing activation"):
        dependent.wait(5)
    assert ran == []  # a task whose input failed never runs


def test_lane_keeps_working_after_a_failure(ring):
    ring.submit(0, lambda: 1 / 0)
    assert ring.submit(0, lambda: "alive").wait(5) == "alive"


def test_wait_timeout_raises_timeout_error(ring):
    gate = threading.Event()
    ev = ring.submit(0, gate.wait)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=0.2"):
        ev.wait(0.2)
    assert 0.15 < time.monotonic() - t0 < 3
    assert not ev.done()
    gate.set()
    assert ev.wait(5) is True


def test_wait_releases_the_gil(ring):
    # The task needs the GIL to run at all; if wait() held it, this would time out.
    ev = ring.submit(0, lambda: sum(range(10_000)))
    assert ev.wait(5) == sum(range(10_000))
    # And other Python threads make progress while the main thread waits.
    ticks: list[int] = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    ring.submit(1, lambda: time.sleep(0.2)).wait(5)
    stop.set()
    ticker.join()
    assert len(ticks) > 10


def test_bad_arguments_raise_builtin_errors(ring):
    with pytest.raises(IndexError, match="lane 4 out of range for a ring of 4 lanes"):
        ring.submit(4, print)
    with pytest.raises(IndexError, match="lane -1"):
        ring.submit(-1, print)
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        ring.submit(0, 3)
    with pytest.raises(TypeError):
        ring.submit(0, print, [object()])
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        ring.submit(0, print).wait(-1)
    with pytest.raises(ValueError, match="lanes must be in"):
        HostRing(0)
    with pytest.raises(TypeError):
        Event()


def test_submit_after_close_raises(ring):
    ring.close()
    assert ring.closed
    with pytest.raises(RuntimeError, match="closed ring"):
        ring.submit(0, print)
    ring.close()  # idempotent


def test_close_drains_queued_work():
    seen: list[int] = []
    r = HostRing(2)
    for i in range(50):
        r.submit(i % 2, lambda i=i: (time.sleep(0.001), seen.append(i)))
    r.close()
    assert sorted(seen) == list(range(50))
    assert r.pending() == 0


def test_close_with_cancel_fails_queued_tasks():
    r = HostRing(1)
    gate, started = threading.Event(), threading.Event()
    running = r.submit(0, lambda: (started.set(), gate.wait())[1])
    queued = r.submit(0, lambda: "never")
    # Close only once the first task runs: a task still queued is cancelled
    # too (the lane's thread may start late, as under AddressSanitizer).
    assert started.wait(5)
    closer = threading.Thread(target=r.close, kwargs={"cancel_pending": True})
    closer.start()
    deadline = time.monotonic() + 5
    while not r.closed and time.monotonic() < deadline:  # close() has set its flags
        time.sleep(0.001)
    gate.set()
    closer.join(5)
    assert running.wait(1) is True
    with pytest.raises(RuntimeError, match="cancelled"):
        queued.wait(1)


def test_close_from_own_lane_is_refused(ring):
    with pytest.raises(RuntimeError, match="own lanes"):
        ring.submit(0, ring.close).wait(5)


def test_100k_tiny_tasks_no_leak_no_deadlock():
    import gc

    from fastpipe._C import _live_events

    def noop():
        return None

    gc.collect()
    refs_before = sys.getrefcount(noop)
    events_before = _live_events()
    r = HostRing(4)
    last = [None] * 4
    for i in range(100_000):
        lane = i % 4
        # Each task also depends on the previous lane's last task: a chain of
        # cross-lane waits, not just four independent queues.
        dep = last[(lane - 1) % 4]
        last[lane] = r.submit(lane, noop, [dep] if dep is not None else [])
    for ev in last:
        ev.wait(60)
    r.close()
    del last, ev, dep
    gc.collect()
    assert r.pending() == 0
    assert sys.getrefcount(noop) == refs_before  # every task released its fn
    assert _live_events() == events_before  # every EventState was freed


def _run_python(code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout,
    )


def test_clean_shutdown_at_interpreter_exit():
    # Busy lanes, queued work and an unreferenced ring when the interpreter
    # exits: the process must end promptly with status 0 and no crash.
    proc = _run_python(
        """
        import time
        from fastpipe.runtime import HostRing
        keep = HostRing(3)
        for lane in range(3):
            keep.submit(lane, lambda: time.sleep(0.2))
            for _ in range(100):
                keep.submit(lane, lambda: time.sleep(0.01))
        HostRing(2).submit(0, lambda: time.sleep(0.1))
        print("exiting", flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "exiting" in proc.stdout
    assert "Fatal" not in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_interrupts_a_wait():
    proc = _run_python(
        """
        import _thread, threading, time
        from fastpipe.runtime import HostRing
        r = HostRing(1)
        ev = r.submit(0, lambda: time.sleep(3))
        threading.Timer(0.2, _thread.interrupt_main).start()
        t0 = time.monotonic()
        try:
            ev.wait()
        except KeyboardInterrupt:
            print("interrupted after", round(time.monotonic() - t0, 1), flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "interrupted after 0." in proc.stdout


def test_extension_does_not_link_libcudart():
    import fastpipe._C as C

    out = subprocess.run(["readelf", "-d", C.__file__], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("readelf not available")
    assert "libcudart" not in out.stdout
    assert isinstance(C.has_cuda, bool)
    assert isinstance(C.cuda_status(), str)


def test_cuda_backend_is_built_when_headers_exist():
    import os

    import fastpipe._C as C

    headers = os.path.exists("/usr/local/cuda/include/cuda_runtime_api.h")
    if os.environ.get("FASTPIPE_CUDA", "auto") == "0" or not headers:
        pytest.skip("built without CUDA headers")
    assert C.has_cuda
    import torch

    if torch.cuda.is_available():
        stream = C.CudaStream(0, 0)
        event = C.CudaEvent()
        event.record(stream)
        event.synchronize()
        assert event.query() and stream.handle != 0
    else:
        assert C.cuda_runtime_available() is False
        with pytest.raises(RuntimeError, match="CUDA is unavailable"):
            C.CudaStream(0)


def test_close_with_grace_leaves_a_stuck_lane_behind():
    gate, started = threading.Event(), threading.Event()
    r = HostRing(2)
    done = r.submit(0, lambda: (started.set(), gate.wait(30))[1] and "finished")
    quick = r.submit(1, lambda: 7)
    assert quick.wait(5) == 7
    assert started.wait(5)  # running, so close() cannot cancel it
    t0 = time.monotonic()
    r.close(cancel_pending=True, grace=0.2)
    assert time.monotonic() - t0 < 5  # did not wait for the stuck task
    assert r.closed
    gate.set()  # the detached lane finishes on its own, its state still alive
    assert done.wait(5) == "finished"
