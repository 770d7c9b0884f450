"""A zero-bubble schedule given by name runs, from its third step, in the order
its second step's measured action costs favour (``Pipe._order_by_step``,
``fastpipe._plan.order_measured``). The distributed case (every rank given
the same seconds, the same order, gradients exact after it) is in
``test_pipe_distributed.py::test_two_ranks_every_schedule``."""

from __future__ import annotations

import pytest
import torch

import fastpipe._plan as plan_mod
from fastpipe import Pipe
from fastpipe._plan import order_measured
from fastpipe.schedules import build
from tests import models


def _seconds(schedule, per_kind: dict[str, float]) -> dict[tuple[int, str], float]:
    """What a step would have measured: ``per_kind[kind]`` per action."""
    out: dict[tuple[int, str], float] = {}
    for row in schedule.actions:
        for a in row:
            if a.kind.value in per_kind:
                key = (a.stage, a.kind.value)
                out[key] = out.get(key, 0.0) + per_kind[a.kind.value]
    return out


@pytest.mark.parametrize("name,spr,ranks", [("zb-h1", None, 2), ("zb-h1", None, 4), ("zbv", 2, 2),
                                             ("zbv", 2, 4)])
def test_order_measured_follows_the_costs_and_never_holds_more(name, spr, ranks):
    built = build(name, ranks, 8, spr)
    even = order_measured(built, _seconds(built, {"F": 1e-3, "I": 1e-3, "W": 1e-3}))
    assert even is None  # F = I = W: the built-in order is the list scheduler's own
    cost = {"F": 1e-3, "I": 1e-3, "W": 0.2e-3}
    chosen = order_measured(built, _seconds(built, cost))
    assert chosen is not None
    chosen.validate()
    assert chosen.name == name and chosen.stage_to_rank == built.stage_to_rank
    assert chosen.actions != built.actions
    new = chosen.simulate(lambda a: cost[a.kind.value])
    old = built.simulate(lambda a: cost[a.kind.value])
    assert new.makespan < 0.99 * old.makespan
    assert all(a <= b for a, b in zip(new.peak_inflight, old.peak_inflight))
    assert all(a <= b for a, b in zip(new.peak_held, old.peak_held))


def test_order_measured_keeps_an_order_the_costs_do_not_beat():
    built = build("zb-h2", 2, 8)  # the list scheduler's order is not 1 % faster for these
    for w in (0.2e-3, 2e-3):
        assert order_measured(built, _seconds(built, {"F": 1e-3, "I": 1e-3, "W": w})) is None


def test_order_measured_keeps_schedules_with_a_fixed_order():
    built = build("1f1b", 2, 8)
    assert order_measured(built, _seconds(built, {"F": 1e-3, "B": 2e-3})) is None


def _spy(monkeypatch, result=None):
    """Replaces order_measured: records its calls, returns the order for W at
    a quarter of F (or ``result``)."""
    calls = []

    def forced(schedule, seconds):
        calls.append((schedule, dict(seconds)))
        if result is not None:
            return result
        return build(schedule.name, schedule.ranks, schedule.microbatches,
                     schedule.stages // schedule.ranks, costs={"F": 1.0, "I": 1.0, "W": 0.25})

    monkeypatch.setattr(plan_mod, "order_measured", forced)
    return calls


@pytest.mark.parametrize("name,spr,balance", [("zb-h1", None, [3, 3]), ("zbv", 2, [1, 2, 1, 2])])
def test_local_pipe_reorders_after_its_second_step_and_stays_exact(monkeypatch, name, spr, balance):
    calls = _spy(monkeypatch)
    model = models.gpt()
    pipe = Pipe(model, chunks=8, schedule=name, devices=["cpu", "cpu"], stages_per_rank=spr,
                balance=balance)
    built = pipe.schedule
    ref = models.gpt()
    try:
        for step in range(4):
            x, y = models.gpt_batch(16, seed=step)
            loss = pipe.step(x, y, models.lm_loss)
            ref_loss, ref_grads = models.reference(ref, x, y, models.lm_loss, 8)
            torch.testing.assert_close(loss, ref_loss)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, ref_grads[n], msg=f"step {step}: {n}")
            assert (pipe.schedule is built) == (step == 0), step
    finally:
        pipe.close()
    assert len(calls) == 1 and calls[0][0] is built
    seconds = calls[0][1]
    assert set(seconds) == {(a.stage, a.kind.value) for row in built.actions for a in row
                            if a.kind.value in "FIW"}
    assert all(t > 0 for t in seconds.values())


def test_a_schedule_given_as_a_list_or_a_fixed_order_is_never_reordered(monkeypatch):
    calls = _spy(monkeypatch)
    x, y = models.gpt_batch(16)
    for schedule in (build("zb-h1", 2, 8), "1f1b"):
        pipe = Pipe(models.gpt(), chunks=8, schedule=schedule, devices=["cpu", "cpu"])
        before = pipe.schedule
        try:
            for _ in range(3):
                pipe.step(x, y, models.lm_loss)
        finally:
            pipe.close()
        assert pipe.schedule is before
    assert calls == []


def test_deterministic_algorithms_keep_the_order(monkeypatch):
    calls = _spy(monkeypatch)
    x, y = models.gpt_batch(16)
    pipe = Pipe(models.gpt(), chunks=8, schedule="zb-h1", devices=["cpu", "cpu"])
    before = pipe.schedule
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    try:
        for _ in range(3):
            pipe.step(x, y, models.lm_loss)
    finally:
        pipe.close()
    assert pipe.schedule is before and calls == []


class _FakeEvent:
    """Stands in for a timing CUDA event: its "device" clock runs at a tenth of the host's."""

    def __init__(self) -> None:
        import time

        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return (end.t - self.t) * 1e3 / 10  # milliseconds, as torch.cuda.Event's


def test_on_a_gpu_the_order_follows_device_times_not_the_hosts(monkeypatch):
    """On a GPU the host's span of an action is the time to queue it: the
    measured step times each compute action between events on its stream,
    and the order is simulated from those (``TimelineRecord.seconds``)."""
    from fastpipe.runtime.executor import RankExecutor

    monkeypatch.setattr(RankExecutor, "_on_gpu", lambda self: True)
    monkeypatch.setattr(RankExecutor, "_event", lambda self: _FakeEvent())
    calls = _spy(monkeypatch, result=None)
    model = models.gpt()
    pipe = Pipe(model, chunks=8, schedule="zb-h1", devices=["cpu", "cpu"], balance=[3, 3])
    try:
        x, y = models.gpt_batch(16)
        pipe.step(x, y, models.lm_loss)
        _, step = pipe.step_with_timeline(x, y, models.lm_loss)  # the measured (second) step
    finally:
        pipe.close()
    compute = [r for r in step.timeline if r.track == "compute"]
    assert compute and all(r.device is not None for r in compute)
    assert all(r.device is None for r in step.timeline if r.track == "comm")
    for r in compute:  # the timeline keeps the host's times (ms); the cost is the device's (s)
        assert r.seconds == r.device and 0 < r.device < (r.end - r.start) / 1e3 / 5
    (_, seconds), = calls
    host = {}
    for r in compute:
        key = (r.action.stage, r.action.kind.value)
        host[key] = host.get(key, 0.0) + (r.end - r.start) / 1e3
    assert set(seconds) == set(host)
    for key, t in seconds.items():
        assert t == pytest.approx(sum(r.device for r in compute
                                      if (r.action.stage, r.action.kind.value) == key))
        assert t < host[key] / 5
