"""Overlap of compute with communication: a test that cannot pass without it.

Compute is a layer that sleeps (a fixed time that needs no CPU, so the test
holds on a loaded 2-core machine) and every transfer is delayed by as long
as one microbatch's compute on a rank. With communication on the ring's
send lanes the delay hides behind compute; inline it adds up.

The schedule is GPipe: 1F1B on two ranks cannot hide such a delay by
construction, because each of its steady-state cycles waits for a message
both ways (the simulator, F = B = 1 and a latency of 2 per message, gives
66 units for 16 microbatches, more than the 64 of compute plus transfers in
sequence), while GPipe's forwards run ahead (38 against 34 without delay).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime.transport import LocalTransport

F_S = B_S = 0.010  # seconds of "compute" per layer call
CHUNKS = 8


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(F_S)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(B_S)
        return grad


class Sleep(nn.Module):
    """Costs F_S in forward and B_S in backward; passes its input through."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _SleepFn.apply(x) * self.scale


_DELIVER = LocalTransport._deliver


def _step_time(monkeypatch, overlap: bool, delay: float) -> float:
    def slow(self, *args):
        time.sleep(delay)  # the link: this long per message
        _DELIVER(self, *args)

    monkeypatch.setattr(LocalTransport, "_deliver", slow)
    pipe = Pipe(nn.Sequential(Sleep(), Sleep()), chunks=CHUNKS, schedule="gpipe",
                devices=["cpu", "cpu"], overlap=overlap)
    x, y = torch.randn(CHUNKS, 3), torch.randn(CHUNKS, 3)
    try:
        pipe.step(x, y, nn.functional.mse_loss)  # warm-up
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            pipe.step(x, y, nn.functional.mse_loss)
            times.append(time.perf_counter() - t0)
        return min(times)
    finally:
        pipe.close()


@pytest.mark.timeout(120)
def test_send_lane_hides_transfer_delay(monkeypatch):
    delay = F_S + B_S  # one microbatch's compute on one rank
    inline = _step_time(monkeypatch, overlap=False, delay=delay)
    lanes = _step_time(monkeypatch, overlap=True, delay=delay)
    compute = CHUNKS * (F_S + B_S)  # per rank
    # Inline, each rank pays compute + its m sends in sequence (~0.48 s here);
    # on the lanes, sends overlap compute and the step is ~0.36 s (the send
    # lane of each rank is busy m x delay, in the forward then the backward
    # phase). The margin leaves room for a loaded machine.
    assert inline >= 2 * compute
    assert lanes < 0.85 * inline, (lanes, inline)


@pytest.mark.timeout(120)
def test_results_do_not_depend_on_overlap():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 2)).double()
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64)
    grads = []
    for overlap in (False, True):
        model.zero_grad()
        pipe = Pipe(model, chunks=3, schedule="zbv", stages_per_rank=2,
                    devices=["cpu", "cpu"], overlap=overlap)
        loss = pipe.step(x, y, nn.functional.mse_loss)
        pipe.close()
        grads.append((loss, [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
