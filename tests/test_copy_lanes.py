"""The copy path of local mode (what GPUs use), run on CPU with host lanes.

On CUDA devices a local transfer is a copy on the sender's copy lane into a
slot of the receiver's ring, ordered by events (``runtime/lanes.py``,
``CopyTransport``). The transport code is the same with host lanes, so these
tests force that path on CPU devices: gradients, slot counts, the waits (a
delayed copy must be waited for), fences, failures.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime import lanes as lanes_mod
from fastpipe.runtime.buffers import BufferRing, copy_slots, last_use
from fastpipe.schedules import Kind, build, lower, names
from tests.models import (embedding_model, gpt, gpt_batch, lm_loss, mlp, reference, tied_embedding_model,
                          tuple_model)
from bench._runner import switched
from tests.support import FailsOnce

F = nn.functional
SPR = {"interleaved-1f1b": 2, "looped-bfs": 2, "zbv": 2, "dualpipev": 2}


def _pipe(model, schedule, ranks, chunks, **kw) -> Pipe:
    with switched(copy_lanes="1"):  # the GPU path, on host lanes
        pipe = Pipe(model, chunks=chunks, schedule=schedule, devices=["cpu"] * ranks,
                    stages_per_rank=SPR.get(schedule), **kw)
    assert pipe._runner.copies
    return pipe


def _check(model_fn, x, y, schedule, ranks, chunks, balance=None, steps=1, exact_slots=False):
    ref_model = model_fn()
    ref_loss, ref_grads = reference(ref_model, x, y, F.mse_loss, chunks)
    model = model_fn()
    pipe = _pipe(model, schedule, ranks, chunks, balance=balance)
    try:
        for _ in range(steps):
            for p in model.parameters():
                p.grad = None
            loss = pipe.step(x, y, F.mse_loss)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), ref_model(x), rtol=1e-10, atol=1e-12)
        if exact_slots:  # no ring grew past the worst case over every timing
            rings = pipe._runner.recv_rings
            assert {k: r.size for k, r in rings.rings.items()} == {k: rings.sizes[k] for k in rings.rings}
        return pipe
    finally:
        pipe.close()


@pytest.mark.parametrize("schedule", names())
@pytest.mark.parametrize("ranks,chunks", [(2, 4), (4, 5)])
def test_every_schedule_matches_sequential_through_copies(schedule, ranks, chunks):
    stages = ranks * SPR.get(schedule, 1)
    torch.manual_seed(1)
    x, y = torch.randn(11, 5, dtype=torch.float64), torch.randn(11, 3, dtype=torch.float64)
    pipe = _check(lambda: mlp(depth=max(stages, 6) + 2), x, y, schedule, ranks, chunks)
    assert pipe._runner.recv_rings.rings, "no transfer went through the receive rings"


@pytest.mark.parametrize("schedule", ["gpipe", "zbv"])
def test_tuple_and_integer_values_through_copies(schedule):
    torch.manual_seed(3)
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    balance = [1, 1, 1, 3] if schedule == "zbv" else [2, 4]
    _check(tuple_model, x, y, schedule, 2, 3, balance=balance)
    tokens = torch.randint(0, 11, (8, 4))
    _check(embedding_model, tokens, torch.randn(8, 4, 3, dtype=torch.float64), schedule, 2, 4)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2", "dualpipev"])
def test_steady_state_allocates_no_slot(schedule):
    torch.manual_seed(5)
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    model = mlp(depth=8)
    pipe = _pipe(model, schedule, 2, 8)
    try:
        pipe.step(x, y, F.mse_loss)
        pipe.step(x, y, F.mse_loss)
        before = {k: (r.size, r.allocations) for k, r in pipe._runner.recv_rings.rings.items()}
        for _ in range(3):
            pipe.step(x, y, F.mse_loss)
        after = {k: (r.size, r.allocations) for k, r in pipe._runner.recv_rings.rings.items()}
        assert after == before
        assert all(r.held == 0 for r in pipe._runner.recv_rings.rings.values())
        # Never more than the worst case copy_slots computed (each ring starts there).
        assert {k: r.size for k, r in pipe._runner.recv_rings.rings.items()} == {
            k: n for k, n in pipe._runner.recv_rings.sizes.items() if k in pipe._runner.recv_rings.rings}
    finally:
        pipe.close()


def test_rings_start_at_the_schedules_worst_case():
    """1F1B, 2 ranks, 8 microbatches: in training each rank can be at most two
    messages ahead of the other; in inference rank 0 may send all 8
    activations before rank 1 takes one, and the rings serve both."""
    torch.manual_seed(6)
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    pipe = _pipe(mlp(depth=8), "1f1b", 2, 8)
    try:
        pipe.step(x, y, F.mse_loss)
        assert pipe._runner.recv_rings.sizes == {("F", 1): 8, ("B", 0): 2}
    finally:
        pipe.close()


def test_a_slow_copy_is_waited_for(monkeypatch):
    """Every copy is delayed and lands after the sender moved on: a consumer
    that did not wait on the copy's event would read a stale or empty slot."""
    real = lanes_mod.HostLanes.copy
    rng = torch.Generator().manual_seed(0)

    def slow(self, dst, regions, after=()):
        delay = float(torch.rand((), generator=rng)) * 3e-3
        event = self.ring.submit(self.copy_lane, lambda: time.sleep(delay),
                                 [e for e in after if e is not None])
        return real(self, dst, regions, after=(event,))

    monkeypatch.setattr(lanes_mod.HostLanes, "copy", slow)
    torch.manual_seed(7)
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    for schedule in ("1f1b", "zbv"):
        _check(lambda: mlp(depth=8), x, y, schedule, 2, 6, steps=3, exact_slots=True)


def test_sources_are_kept_until_their_copy_ran(monkeypatch):
    """The producer's tensor may be freed as soon as it is sent: the transport
    holds it until the copy's event is done (no record_stream)."""
    gate = threading.Event()
    real = lanes_mod.HostLanes.copy

    def gated(self, dst, regions, after=()):
        event = self.ring.submit(self.copy_lane, lambda: gate.wait(5), [e for e in after if e])
        return real(self, dst, regions, after=(event,))

    monkeypatch.setattr(lanes_mod.HostLanes, "copy", gated)
    threading.Timer(0.2, gate.set).start()
    torch.manual_seed(8)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    _check(lambda: mlp(depth=6), x, y, "gpipe", 2, 4)


def test_a_failed_copy_fails_the_step_everywhere(monkeypatch):
    def broken(self, dst, regions, after=()):
        def fail():
            raise OSError("copy engine on fire")
        return self.ring.submit(self.copy_lane, fail)

    monkeypatch.setattr(lanes_mod.HostLanes, "copy", broken)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe = _pipe(mlp(depth=6), "1f1b", 2, 4, timeout=10)
    try:
        start = time.monotonic()
        with pytest.raises(OSError, match="copy engine on fire"):
            pipe.step(x, y, F.mse_loss)
        assert time.monotonic() - start < 5  # at once, not after the timeout
    finally:
        pipe.close()


class _DeviceFence:
    """Stands in for a CudaEvent: not a ring Event, so the ring hands it on."""

    def __init__(self) -> None:
        self.synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True


def test_device_fences_go_to_the_slots_next_writer():
    ring = BufferRing(1, torch.device("cpu"), growable=True, timeout=1)
    slot, _ = ring.get(64)
    fence = _DeviceFence()
    ring.put(slot, fence)
    again, _ = ring.get(64)  # the host does not wait for a device fence
    assert again == slot and ring.fence_of(again) is fence and ring.fence_of(again) is None
    ring.put(again, None)


def test_a_growing_slot_waits_for_its_last_reader_before_freeing_the_old_buffer():
    ring = BufferRing(1, torch.device("cpu"), growable=True, timeout=1)
    slot, _ = ring.get(64)
    fence = _DeviceFence()
    ring.put(slot, fence)
    again, buf = ring.get(4096)  # a bigger buffer replaces the old one
    assert fence.synchronized and buf.numel() == 4096 and ring.fence_of(again) is None


def _message(a) -> tuple | None:
    """The key of the message a SEND action sends, or a compute action may wait for."""
    if a.kind is Kind.SEND_F:
        return ("F", a.stage + 1, a.microbatch)
    if a.kind is Kind.SEND_B:
        return ("B", a.stage - 1, a.microbatch)
    if a.kind is Kind.F:
        return ("F", a.stage, a.microbatch)
    if a.kind in (Kind.B, Kind.I):
        return ("B", a.stage, a.microbatch)
    return None


def _random_timing_peaks(actions, rng) -> dict:
    """Runs the ranks' lists in one random interleaving the dependencies allow
    and returns the most slots each stream held at once (a slot is taken at
    SEND and freed after the receiver's last compute action of that stage and
    microbatch)."""
    sends = {_message(a) for acts in actions for a in acts if a.kind in (Kind.SEND_F, Kind.SEND_B)}
    last = [last_use(acts) for acts in actions]
    arrived, holding, peak = set(), set(), {}
    pos = [0] * len(actions)
    # Each run favours some ranks strongly, so a rank runs far ahead at times.
    weights = torch.rand(len(actions), generator=rng) ** 6 + 1e-6
    while any(p < len(acts) for p, acts in zip(pos, actions)):
        ready = []
        for r, acts in enumerate(actions):
            if pos[r] < len(acts):
                a = acts[pos[r]]
                need = _message(a) if a.kind not in (Kind.SEND_F, Kind.SEND_B) else None
                if need not in sends or need in arrived:
                    ready.append(r)
        r = ready[int(torch.multinomial(weights[ready], 1, generator=rng))]
        i, a = pos[r], actions[r][pos[r]]
        pos[r] += 1
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            key = _message(a)
            arrived.add(key)
            holding.add(key)
            count = sum(1 for k in holding if k[:2] == key[:2])
            peak[key[:2]] = max(peak.get(key[:2], 0), count)
        for key in [k for k in holding if last[r].get(k[1:]) == i]:
            holding.discard(key)
    return peak


@pytest.mark.parametrize("schedule,ranks,chunks", [
    ("gpipe", 2, 4), ("1f1b", 2, 6), ("1f1b", 4, 6), ("zb-h1", 3, 5), ("zb-h2", 2, 6),
    ("zbv", 2, 5), ("dualpipev", 2, 6), ("interleaved-1f1b", 2, 4), ("looped-bfs", 2, 4),
])
def test_copy_slots_is_the_worst_case_over_timings(schedule, ranks, chunks):
    """Random interleavings never need more slots than copy_slots, and some reach it."""
    lowered = lower(build(schedule, ranks=ranks, microbatches=chunks,
                          **({"stages_per_rank": SPR[schedule]} if schedule in SPR else {})))
    bound = copy_slots(lowered.actions)
    rng = torch.Generator().manual_seed(0)
    seen: dict = {}
    for _ in range(300):
        for stream, n in _random_timing_peaks(lowered.actions, rng).items():
            assert n <= bound[stream], (stream, n, bound[stream])
            seen[stream] = max(seen.get(stream, 0), n)
    assert seen == bound


def test_cuda_lanes_say_why_they_cannot_start():
    from fastpipe._ext import native

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="cuda:0"):
        lanes_mod.CudaLanes(torch.device("cuda:0"))
    assert isinstance(native().cuda_status(), str)


def test_a_failed_step_leaves_no_slot_held(monkeypatch):
    """Messages nobody took after a failure held slots: the next step starts
    with fresh rings, sized as before, and trains correctly."""
    torch.manual_seed(9)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    model = mlp(depth=6)
    pipe = _pipe(model, "gpipe", 2, 4, timeout=10)
    calls = {"n": 0}
    real = nn.Linear.forward

    def flaky(self, inp):
        calls["n"] += 1
        if calls["n"] == 14:  # in rank 1's forwards, after rank 0 has sent ahead
            raise ValueError("flaky layer")
        return real(self, inp)

    try:
        monkeypatch.setattr(nn.Linear, "forward", flaky)
        with pytest.raises(ValueError, match="flaky layer"):
            pipe.step(x, y, F.mse_loss)
        monkeypatch.setattr(nn.Linear, "forward", real)
        assert pipe._runner.recv_rings is None
        for p in model.parameters():
            p.grad = None
        loss = pipe.step(x, y, F.mse_loss)
        ref_loss, ref_grads = reference(mlp(depth=6), x, y, F.mse_loss, 4)
        torch.testing.assert_close(loss, ref_loss)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], msg=name)
        assert all(r.held == 0 for r in pipe._runner.recv_rings.rings.values())
    finally:
        pipe.close()


def _gpt_case():
    x, y = gpt_batch(8)
    return gpt, x, y, lm_loss


def _tied_case():
    torch.manual_seed(10)
    return tied_embedding_model, torch.randint(0, 11, (8, 4)), torch.randn(8, 4, 3, dtype=torch.float64), F.mse_loss


@pytest.mark.parametrize("case", [_gpt_case, _tied_case], ids=["gpt", "tied-embedding"])
def test_pipes_rebuilt_over_one_model_train_it_as_the_unsplit_model(case):
    """Build, step, drop, build again over the same model, with another
    schedule, after a failed step, with an optimizer step in between: each
    step's gradients and the parameters after it are the unsplit model's.
    (On a GPU the same sequence crashed once the first Pipe's streams were
    gone: tests/test_streams.py.)"""
    model_fn, x, y, loss_fn = case()
    chunks = 4
    model, ref = model_fn(), model_fn()
    # SGD, not Adam: Adam scales a gradient that rounding alone made
    # (attention's key bias, exactly zero in theory) up to the learning rate.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for schedule, fail_first, close in [("1f1b", False, True), ("zbv", False, False),
                                        ("gpipe", True, True), ("1f1b", True, False)]:
        if fail_first:
            pipe = _pipe(model, schedule, 2, chunks, timeout=10)
            with pytest.raises(ValueError, match="loss failed once"):
                pipe.step(x, y, FailsOnce(loss_fn, at=3))
            pipe.close()
            del pipe
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        pipe = _pipe(model, schedule, 2, chunks, timeout=10)
        loss = pipe.step(x, y, loss_fn)
        ref_loss, ref_grads = reference(ref, x, y, loss_fn, chunks)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12, msg=schedule)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-10, atol=1e-12,
                                       msg=f"{schedule}: {name}")
        opt.step()
        ref_opt.step()
        if close:
            pipe.close()
        del pipe  # dropped without close() too: the streams go back when collected
        gc.collect()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)


def test_close_gives_the_device_lanes_back_and_a_later_step_makes_new_ones():
    torch.manual_seed(11)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe = _pipe(mlp(depth=6), "1f1b", 2, 4)
    closed = []
    pipe.step(x, y, F.mse_loss)
    for lanes in pipe._runner.device_lanes.values():
        lanes.close = lambda lanes=lanes: closed.append(lanes)
    held = list(pipe._runner.device_lanes.values())
    pipe.close()
    assert closed == held and not pipe._runner.device_lanes
    pipe.step(x, y, F.mse_loss)  # usable after close(), as before
    assert pipe._runner.device_lanes and all(a is not b for a, b in zip(pipe._runner.device_lanes.values(), held))
    pipe.close()


def test_an_interrupted_step_still_hands_the_lanes_back_to_the_caller(monkeypatch):
    """Ctrl-C in a step: the caller's stream must still wait for the work the
    ranks queued (``exit_to_caller``) before anything it runs next."""
    import _thread

    class Slow(nn.Module):
        def forward(self, x):
            time.sleep(0.05)
            return x

    exits = []
    monkeypatch.setattr(lanes_mod.HostLanes, "exit_to_caller", lambda self: exits.append(self))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), Slow(), nn.Linear(5, 3)).double()
    pipe = _pipe(model, "1f1b", 2, 4, balance=[2, 1])
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    timer = threading.Timer(0.1, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            pipe.step(x, y, F.mse_loss)
        assert len(exits) == 2 and len({id(e) for e in exits}) == 2
        loss = pipe.step(x, y, F.mse_loss)  # and the next step works
        assert torch.isfinite(loss) and len(exits) == 4
    finally:
        timer.cancel()
        pipe.close()
