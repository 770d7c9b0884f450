"""The process's CUDA stream pool: leases, reuse, nothing destroyed (runtime/streams.py)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from fastpipe.runtime.streams import StreamPool, cuda_streams


class _Stream:
    """Stands in for a CudaStream: records what it was made with."""

    def __init__(self, device: int, priority: int) -> None:
        self.device, self.priority = device, priority


def _pool() -> tuple[StreamPool, list[_Stream]]:
    made: list[_Stream] = []

    def make(device: int, priority: int) -> _Stream:
        made.append(_Stream(device, priority))
        return made[-1]

    return StreamPool(make), made


def test_a_released_stream_is_handed_out_again_for_the_same_key():
    pool, made = _pool()
    a = pool.acquire(0, "compute", 0)
    pool.release(a)
    assert pool.acquire(0, "compute", 0) is a
    assert len(made) == 1 and (a.device, a.priority) == (0, 0)


def test_streams_held_at_once_are_distinct():
    """Two ranks on one device (or two Pipes alive at once) get a stream each."""
    pool, made = _pool()
    a, b = pool.acquire(0, "compute", 0), pool.acquire(0, "compute", 0)
    assert a is not b and len(made) == 2 and pool.leased() == 2
    pool.release(b)
    pool.release(a)
    # The first stream free is handed out first: a rebuilt Pipe gets the same streams.
    assert pool.acquire(0, "compute", 0) is a and pool.acquire(0, "compute", 0) is b
    assert pool.made(0, "compute", 0) == (a, b)


@pytest.mark.parametrize("other", [(1, "compute", 0), (0, "copy", 0), (0, "compute", -5)])
def test_device_role_and_priority_each_keep_their_own_streams(other):
    pool, _ = _pool()
    a = pool.acquire(0, "compute", 0)
    pool.release(a)
    b = pool.acquire(*other)
    assert b is not a and (b.device, b.priority) == (other[0], other[2])
    assert pool.made(*other) == (b,)


def test_a_stream_given_back_twice_is_refused():
    pool, _ = _pool()
    a = pool.acquire(0, "copy", -5)
    pool.release(a)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(a)
    with pytest.raises(ValueError, match="not leased"):
        pool.release(_Stream(0, 0))


def test_the_pool_never_drops_a_stream():
    """Made streams stay referenced by the pool whether leased or not."""
    pool, made = _pool()
    streams = [pool.acquire(0, "compute", 0) for _ in range(3)]
    for s in streams:
        pool.release(s)
    ids = [id(s) for s in made]
    del streams, made
    gc.collect()
    assert [id(s) for s in pool.made(0, "compute", 0)] == ids


def test_threads_acquiring_at_once_never_share_a_stream():
    pool, made = _pool()
    held: set[int] = set()
    shared: list[int] = []
    lock, start = threading.Lock(), threading.Barrier(8)

    def take():
        start.wait()
        for _ in range(200):
            s = pool.acquire(0, "compute", 0)
            with lock:
                if id(s) in held:
                    shared.append(id(s))
                held.add(id(s))
            with lock:
                held.discard(id(s))
            pool.release(s)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not shared, "a leased stream was handed out again"
    assert pool.leased() == 0 and 1 <= len(made) <= 8


def test_failed_creation_keeps_nothing():
    def make(device, priority):
        raise ValueError(f"priority {priority} outside this device's range")

    pool = StreamPool(make)
    with pytest.raises(ValueError, match="priority"):
        pool.acquire(0, "copy", -99)
    assert pool.leased() == 0 and pool.made(0, "copy", -99) == ()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_lanes_of_a_rebuilt_pipe_reuse_the_streams():
    """Closing lanes gives their streams back; the next lanes on the device get them again."""
    from fastpipe.runtime.lanes import CudaLanes

    first = CudaLanes(torch.device("cuda:0"))
    streams = (first.compute_stream, first.copy_stream)
    other = CudaLanes(torch.device("cuda:0"))  # alive at once: streams of its own
    assert {id(other.compute_stream), id(other.copy_stream)}.isdisjoint(map(id, streams))
    first.close()
    again = CudaLanes(torch.device("cuda:0"))
    assert (again.compute_stream, again.copy_stream) == streams
    other.close()
    del again
    gc.collect()  # collected lanes give their streams back too
    assert cuda_streams().acquire(0, "compute", 0) is streams[0]
    cuda_streams().release(streams[0])


@needs_cuda
def test_a_second_pipe_over_one_model_steps_after_the_first_is_dropped():
    """The crash this pool fixes: Pipe on cuda:0 ×2, step, drop, new Pipe, step."""
    from fastpipe import Pipe
    from tests.models import mlp, reference

    model = mlp(depth=8).cuda()
    x = torch.randn(16, 5, dtype=torch.float64, device="cuda")
    y = torch.randn(16, 3, dtype=torch.float64, device="cuda")
    for schedule in ("1f1b", "gpipe", "zbv"):
        pipe = Pipe(model, chunks=4, schedule=schedule, devices=["cuda:0", "cuda:0"],
                    stages_per_rank=2 if schedule == "zbv" else None)
        model.zero_grad(set_to_none=True)
        pipe.step(x, y, torch.nn.functional.mse_loss)
        del pipe
        gc.collect()
    torch.cuda.synchronize()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _, want = reference(model, x, y, torch.nn.functional.mse_loss, 4)
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-10, atol=1e-12, msg=name)


def test_the_module_example_runs():
    import doctest

    import fastpipe.runtime.streams as streams

    assert doctest.testmod(streams).failed == 0
