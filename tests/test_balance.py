"""Balance and plan: exact partitions, the profiler, the planner and memory accounting."""

from __future__ import annotations

import dataclasses
import itertools
import random
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe import Pipe, plan
from fastpipe._plan import parse_bytes
from fastpipe.balance import balance_by_size, balance_by_time, partition, profile
from tests.models import mlp, reference


def _brute(costs, parts, speeds):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = (0, *cuts, len(costs))
        worst = max(sum(costs[a:b]) / speeds[i] for i, (a, b) in enumerate(zip(bounds, bounds[1:])))
        best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.data())
def test_partition_is_optimal(costs, data):
    parts = data.draw(st.integers(1, len(costs)))
    speeds = data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=parts, max_size=parts))
    sizes = partition(costs, parts, speeds)
    assert len(sizes) == parts and all(n >= 1 for n in sizes) and sum(sizes) == len(costs)
    bounds = [0, *itertools.accumulate(sizes)]
    got = max(sum(costs[a:b]) / speeds[i] for i, (a, b) in enumerate(zip(bounds, bounds[1:])))
    assert got == pytest.approx(_brute(costs, parts, speeds))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=9), st.data())
def test_partition_by_rank_is_optimal(costs, data):
    """With owners, the busiest rank's sum is the smallest any split gives
    (then the largest part); one part per rank is the plain partition."""
    ranks = data.draw(st.integers(1, max(1, len(costs) // 2)))
    per = data.draw(st.integers(1, len(costs) // ranks))
    owners = [data.draw(st.integers(0, ranks - 1)) for _ in range(ranks * per)]
    owners[:ranks] = range(ranks)  # every rank owns a part
    parts = len(owners)

    def score(sizes):
        bounds = [0, *itertools.accumulate(sizes)]
        loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        per_rank = [sum(load for k, load in zip(owners, loads) if k == r) for r in range(ranks)]
        return max(per_rank), max(loads)

    sizes = partition(costs, parts, owners=owners)
    assert len(sizes) == parts and all(n >= 1 for n in sizes) and sum(sizes) == len(costs)
    best = min(score([b - a for a, b in zip((0, *cuts), (*cuts, len(costs)))])
               for cuts in itertools.combinations(range(1, len(costs)), parts - 1))
    assert score(sizes) == best


def test_partition_evens_the_ranks_of_a_v():
    """A V puts the first and the last stage on rank 0: a cheap embedding and
    a costly head there, blocks in between. Even parts leave rank 1 with
    four blocks; balancing ranks gives it three."""
    costs = [0.05, 1, 1, 1, 1, 1, 1, 0.8]
    assert partition(costs, 4) == [2, 2, 2, 2]
    assert partition(costs, 4, owners=[0, 1, 1, 0]) == [3, 1, 2, 2]
    assert partition(costs, 4, owners=[0, 1, 2, 3]) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="owners must name a rank for each of the 4 parts"):
        partition(costs, 4, owners=[0, 1])
    # Too many splits to try: local search still evens the ranks of a long V.
    long = [1.0] * 200 + [30.0]
    sizes = partition(long, 8, owners=[0, 1, 2, 3, 3, 2, 1, 0])
    bounds = [0, *itertools.accumulate(sizes)]
    loads = [sum(long[a:b]) for a, b in zip(bounds, bounds[1:])]
    per_rank = [loads[k] + loads[7 - k] for k in range(4)]
    assert max(per_rank) - min(per_rank) <= 2.0


def test_partition_rejects_bad_speeds():
    with pytest.raises(ValueError, match="speeds must hold 2"):
        partition([1, 2, 3], 2, [1.0])
    with pytest.raises(ValueError, match="positive"):
        partition([1, 2, 3], 2, [1.0, 0.0])


class _Busy(nn.Module):
    """Sleeps ``ms`` in forward and in backward: a layer with a known cost."""

    def __init__(self, ms: float, width: int = 4):
        super().__init__()
        self.ms, self.lin = ms, nn.Linear(width, width)

    def forward(self, x):
        return _SleepFn.apply(self.lin(x), self.ms)


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ms):
        ctx.ms = ms
        time.sleep(ms / 1e3)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.ms / 1e3)
        return g, None


def test_profile_counts_bytes_and_times():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), _Busy(5.0, 16))
    prof = profile(model, torch.randn(12, 8), chunks=3, repeats=3, warmup=1)
    assert prof.rows == 4
    lin, relu, busy = prof.layers
    assert lin.param_bytes == (8 * 16 + 16) * 4 and relu.param_bytes == 0
    assert lin.activation_bytes == 4 * 8 * 4  # the input; the weight is a parameter
    assert relu.activation_bytes == 4 * 16 * 4  # its output
    assert lin.output_bytes == 4 * 16 * 4
    assert 4e-3 < busy.forward < 20e-3 and 4e-3 < busy.backward < 20e-3
    assert relu.weight_backward < 1e-3  # nothing to do
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no grads


@pytest.mark.parametrize("window", [1, 2, 3])
def test_profile_windows_time_every_layer(window):
    """Runs of consecutive layers that do not divide the model still time
    every layer, and the bytes do not depend on how layers are grouped."""
    torch.manual_seed(0)
    model = nn.Sequential(_Busy(2.0, 4), nn.Linear(4, 4), _Busy(2.0, 4), nn.Linear(4, 4))
    prof = profile(model, torch.randn(8, 4), chunks=2, repeats=2, warmup=0, window=window)
    assert [x.param_bytes for x in prof.layers] == [80] * 4  # (4 x 4 + 4) floats each
    # Each 2 ms sleep is in its own layer's times, and not a whole window's
    # (the bound is loose: a loaded machine stretches a 2 ms sleep to 13 ms).
    for busy in prof.layers[0], prof.layers[2]:
        assert 2e-3 < busy.forward < 40e-3 and 2e-3 < busy.backward < 40e-3
    # The sleep is on the way to each Linear's output, whose gradient W
    # needs: I runs it, even where the model's input needs no gradient;
    # W is the Linears' deferred weight gradients alone.
    for busy in prof.layers[0], prof.layers[2]:
        assert 2e-3 < busy.input_backward < 40e-3
        assert 0 < busy.weight_backward < 2e-3
    assert all(p.grad is None for p in model.parameters())


def test_profiling_leaves_the_buffers_and_the_generator_as_they_were():
    # balance="auto" profiles before the first step: a BatchNorm counting
    # those runs, or dropout drawing from the user's generator, would make
    # the step differ from the unsplit loop's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 3))
    before = {n: b.clone() for n, b in model.named_buffers()}
    x, y = torch.randn(12, 8), torch.randn(12, 3)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    profile(model, x, chunks=3, repeats=2, warmup=1, fit_rows=2, loss_fn=nn.functional.mse_loss,
            target=y)
    assert torch.equal(torch.rand(3), expected)
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), name


@pytest.mark.parametrize("window", [0, -1, 1.5, True])
def test_profile_rejects_bad_window(window):
    with pytest.raises(ValueError, match="window"):
        profile(nn.Sequential(nn.Linear(4, 4)), torch.randn(4, 4), window=window)


@pytest.mark.parametrize("repeats, warmup", [(0, 1), (2, -1)])
def test_profile_rejects_bad_repeats(repeats, warmup):
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile(nn.Sequential(nn.Linear(4, 4)), torch.randn(4, 4), repeats=repeats, warmup=warmup)


def test_balance_by_time_follows_measured_cost():
    model = nn.Sequential(_Busy(1), _Busy(1), _Busy(1), _Busy(6))
    assert balance_by_time(2, model, torch.randn(4, 4)) == [3, 1]
    # a stage twice as fast takes twice the work
    assert balance_by_time(2, nn.Sequential(*[_Busy(2) for _ in range(6)]), torch.randn(4, 4),
                           speeds=[2.0, 1.0]) == [4, 2]


def test_balance_by_size_follows_memory():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 1024))
    assert balance_by_size(2, model, torch.randn(8, 64), chunks=2) == [3, 1]


def _plan_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])


def test_plan_prefers_the_simulated_fastest_and_explains():
    model = _plan_model()
    result = plan(model, torch.randn(32, 32), 2, schedules=["gpipe", "1f1b", "zb-h1"],
                  chunks=[2, 4, 8], checkpoints=["never"])
    assert result.best == result.candidates[0]
    assert result.best.step_seconds == min(c.step_seconds for c in result.candidates)
    text = result.explain(top=3)
    assert "schedule" in text and result.best.schedule in text
    kwargs = result.pipe_kwargs()
    pipe = Pipe(model, plan=result, devices=["cpu", "cpu"])
    assert (pipe.chunks, pipe.schedule.name, pipe.balance) == (kwargs["chunks"], kwargs["schedule"],
                                                               kwargs["balance"])
    with pytest.raises(ValueError, match="disagrees with the plan"):
        Pipe(model, plan=result, chunks=kwargs["chunks"] + 1, devices=["cpu", "cpu"])
    pipe.close()


def test_a_plan_names_its_choices_and_says_why_it_does_not_pipeline():
    from fastpipe._plan import Candidate, Plan

    one = Candidate("gpipe", 1, 1, (2, 2), "never", 0.010, 0.5, (100, 100))
    four = Candidate("1f1b", 4, 1, (1, 3), "always", 0.012, 0.2, (80, 90))
    chosen = Plan(one, [one, four])
    assert (chosen.schedule, chosen.chunks, chosen.balance, chosen.stages_per_rank,
            chosen.checkpoint) == ("gpipe", 1, [2, 2], 1, "never")
    why = chosen.why_one_chunk()
    assert "1f1b with 4" in why and "12.00 ms against 10.00 ms" in why
    assert why in chosen.explain()
    assert Plan(four, [four, one]).why_one_chunk() is None
    assert "fits" in Plan(one, [one, four], memory_limit=50).why_one_chunk()


def _step_on_plan(model, made, x, y, loss_fn=nn.functional.mse_loss):
    """One step of ``model`` on two local ranks as ``made`` (a Plan) says:
    the loss and ``memory_stats()``."""
    pipe = Pipe(model, plan=made, devices=["cpu", "cpu"])
    try:
        return pipe.step(x, y, loss_fn), pipe.memory_stats()
    finally:
        pipe.close()


def _set_times(measured):
    """``measured`` with every layer's times set (a weight's layer 1 ms forward, others
    0.1 ms; backward twice the forward): the memory the planner walks stays measured,
    and which split is fastest (the even one, for a stack of equal blocks) no longer
    hangs on a loaded machine's timer, as the limits these tests derive from it do."""
    return dataclasses.replace(measured, layers=tuple(
        dataclasses.replace(p, forward=t, backward=2 * t, input_backward=t, weight_backward=t)
        for p, t in ((p, 1e-3 if p.param_bytes else 1e-4) for p in measured.layers)))


def test_the_walk_counts_the_loss_with_the_last_stage():
    """A language model's cross-entropy saves its log-softmax, vocabulary
    wide: given the loss, the profile books it to the last layer, and the
    planner's walk of the last rank is what the executor books; without it
    the walk is short by about that much."""
    from tests.models import gpt, gpt_batch, lm_loss

    model = gpt(vocab=1024, d=16, heads=2, blocks=2, seq=16, dtype=torch.float32)
    ids, tg = gpt_batch(64, 1024, 16)
    plain = profile(model, ids, "cpu", 8)
    lossy = profile(model, ids, "cpu", 8, loss_fn=lm_loss, target=tg)
    log_softmax = 8 * 16 * 1024 * 4  # a microbatch's rows x vocabulary, fp32
    added = lossy.layers[-1].activation_bytes - plain.layers[-1].activation_bytes
    assert log_softmax <= added < 1.1 * log_softmax, added
    assert [x.activation_bytes for x in lossy.layers[:-1]] == [x.activation_bytes for x in plain.layers[:-1]]
    for prof, exact in ((plain, False), (lossy, True)):
        made = plan(model, ids, 2, schedules=["1f1b"], chunks=[8], checkpoints=["never"],
                    prof=_set_times(prof))
        model.zero_grad(set_to_none=True)
        _, stats = _step_on_plan(model, made, ids, tg, lm_loss)
        booked, walked = stats[1]["peak"], made.best.memory[1]
        assert (booked == pytest.approx(walked, rel=0.02)) is exact, (booked, walked)
    with pytest.raises(ValueError, match="loss_fn and target together"):
        profile(model, ids, "cpu", 8, loss_fn=lm_loss)


def test_auto_balance_profiles_the_loss_in_local_mode(monkeypatch):
    import fastpipe.balance as balance_mod
    from tests.models import gpt, gpt_batch, lm_loss

    seen = []
    real = balance_mod.profile

    def spy(*args, **kwargs):
        seen.append(kwargs.get("loss_fn"))
        return real(*args, **kwargs)

    monkeypatch.setattr(balance_mod, "profile", spy)
    ids, tg = gpt_batch(16)
    pipe = Pipe(gpt(), chunks=4, balance="auto", devices=["cpu", "cpu"])
    try:
        pipe.step(ids, tg, lm_loss)
    finally:
        pipe.close()
    assert seen == [lm_loss]


def test_plan_under_a_memory_limit_fits_what_the_executor_accounts():
    """A limit below what 1F1B without checkpointing needs: the planner picks a
    plan that fits, and the executor's own peak stays under the limit."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))])
    x, y = torch.randn(1024, 64), torch.randn(1024, 64)  # activations outweigh parameters
    prof = _set_times(profile(model, x, "cpu", 8))
    free = plan(model, x, 2, schedules=["1f1b"], chunks=[8], checkpoints=["never"], prof=prof)
    assert list(free.best.balance) == [6, 6]
    need = max(free.best.memory)
    everything = plan(model, x, 2, chunks=[8], prof=free.profile)
    least = min(max(c.memory) for c in everything.candidates)
    assert least < 0.8 * need  # checkpointing saves a lot here
    limit = (least + need) // 2
    tight = plan(model, x, 2, memory_limit=limit, chunks=[8], prof=free.profile)
    assert max(tight.best.memory) <= limit
    assert (tight.best.schedule, tight.best.checkpoint) != ("1f1b", "never")
    _, stats = _step_on_plan(model, tight, x, y)
    for rank, s in stats.items():
        assert s["peak"] <= limit, (rank, s, limit)
        # the planner's walk and the executor's count agree closely
        assert s["peak"] == pytest.approx(tight.best.memory[rank], rel=0.1)
    with pytest.raises(ValueError, match="no plan fits"):
        plan(model, x, 2, memory_limit=1000, chunks=[8], prof=free.profile)


@pytest.mark.parametrize("chains", ["1", "0"])
def test_memory_after_input_backward_is_what_weight_backward_reads(monkeypatch, chains):
    """From I to W a microbatch holds what W reads, not its whole forward:
    running W0 after F1 and I1 instead of before them costs exactly that
    (each Linear's input and output gradient), on chain and autograd stages."""
    from fastpipe.schedules import Action, Kind, Schedule

    monkeypatch.setenv("FASTPIPE_CHAIN", chains)
    monkeypatch.setenv("FASTPIPE_CHAIN_GATHER", "0")  # else W0's share waits for W1's in both
    torch.manual_seed(0)
    # Three Tanh save more than W reads: the first order's peak is then
    # one microbatch's forward plus the other's W bytes.
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Tanh(), nn.Tanh(), nn.Linear(64, 8)).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    peaks = {}
    for text in ("F0 I0 F1 I1 W0 W1", "F0 I0 W0 F1 I1 W1"):
        order = [Action(0, Kind(t[0]), int(t[1:])) for t in text.split()]
        pipe = Pipe(model, chunks=2, devices=["cpu"], schedule=Schedule("custom", 1, 1, 2, (0,), [order]))
        try:
            pipe.step(x, y, nn.functional.mse_loss)
            peaks[text] = pipe.memory_stats()[0]["activations_peak"]
        finally:
            pipe.close()
        model.zero_grad(set_to_none=True)
    rows, width = 4, 8  # a microbatch's rows; float64
    w_reads = rows * width * (8 + 64) + rows * width * (64 + 8)  # inputs and output gradients
    assert peaks["F0 I0 F1 I1 W0 W1"] - peaks["F0 I0 W0 F1 I1 W1"] == w_reads, peaks


def test_a_lean_candidate_counts_what_each_stage_holds_in_bytes():
    """A GPT whose head's W reads five times what its stage saved (the
    logits' gradient): beside the lean zbv that counts microbatches, the
    planner weighs the one whose cap counts each stage's bytes, which walks
    less here and still simulates faster than 1F1B; under a limit between
    the two it is the plan, and the executor books what it walked."""
    from fastpipe._plan import _stage_sums
    from tests.models import gpt, gpt_batch, lm_loss

    model = gpt(vocab=1024, d=16, heads=2, blocks=6, seq=16, dtype=torch.float32)
    ids, tg = gpt_batch(64, 1024, 16)
    prof = _set_times(profile(model, ids, "cpu", 8))
    found = plan(model, ids, 2, schedules=["zbv", "1f1b"], chunks=[8], checkpoints=["never"], prof=prof)
    counted, sized = [next(c for c in found.candidates if c.schedule == "zbv" and c.lean and c.sized is flag)
                      for flag in (False, True)]
    sums = _stage_sums(prof.scaled(8), sized.balance)
    assert sums["weight"][-1] > 4 * sums["act"][-1]
    assert max(sized.memory) < max(counted.memory)
    assert sized.step_seconds < next(c for c in found.candidates if c.schedule == "1f1b").step_seconds
    limit = (max(sized.memory) + max(counted.memory)) // 2
    tight = plan(model, ids, 2, memory_limit=limit, schedules=["zbv"], chunks=[8],
                 checkpoints=["never"], prof=found.profile)
    assert tight.best.sized and "zbv lean/bytes" in tight.explain()
    want_loss, want = reference(model, ids, tg, lm_loss, 8)
    model.zero_grad(set_to_none=True)
    loss, stats = _step_on_plan(model, tight, ids, tg, lm_loss)
    for rank, st in stats.items():
        assert st["peak"] <= limit, (rank, st, limit)
        assert st["peak"] == pytest.approx(tight.best.memory[rank], rel=0.05), (rank, st)
    torch.testing.assert_close(loss, want_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)


def test_a_memory_limit_can_choose_a_lean_zero_bubble_order():
    """Under a limit the default zbv order exceeds, the planner picks the
    lean one (what W reads adds no microbatch), and the run fits and trains
    as the unsplit model does."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))])
    x, y = torch.randn(1024, 64), torch.randn(1024, 64)
    free = plan(model, x, 2, schedules=["zbv"], chunks=[8], checkpoints=["never"],
                prof=_set_times(profile(model, x, "cpu", 8)))
    default, lean = [next(c for c in free.candidates if c.lean is flag) for flag in (False, True)]
    assert max(lean.memory) < 0.8 * max(default.memory)
    limit = (max(lean.memory) + max(default.memory)) // 2
    tight = plan(model, x, 2, memory_limit=limit, schedules=["zbv"], chunks=[8],
                 checkpoints=["never"], prof=free.profile)
    assert tight.best.lean and "zbv lean" in tight.explain()
    want_loss, want = reference(model, x, y, nn.functional.mse_loss, 8)
    model.zero_grad(set_to_none=True)
    loss, stats = _step_on_plan(model, tight, x, y)
    for rank, s in stats.items():
        assert s["peak"] <= limit, (rank, s, limit)
        # what the planner walked (W's gathering queue included) is what ran
        assert s["peak"] == pytest.approx(tight.best.memory[rank], rel=0.05)
    torch.testing.assert_close(loss, want_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)


def test_a_memory_limit_can_move_the_split():
    """1F1B's first rank holds two microbatches to the last rank's one: under
    a limit the fastest split exceeds (and no checkpointing allowed), the
    planner moves layers off the first rank, and the run books what the
    walk said and trains as the unsplit model does."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))])
    x, y = torch.randn(1024, 64), torch.randn(1024, 64)
    prof = _set_times(profile(model, x, "cpu", 8))
    free = plan(model, x, 2, schedules=["1f1b"], chunks=[8], checkpoints=["never"], prof=prof)
    fastest = free.best
    assert list(fastest.balance) == [6, 6]
    assert [c.balance for c in free.candidates] == [fastest.balance]  # no limit: nothing else
    limit = int(0.97 * max(fastest.memory))
    tight = plan(model, x, 2, memory_limit=limit, schedules=["1f1b"], chunks=[8],
                 checkpoints=["never"], prof=free.profile)
    moved = tight.best
    assert max(moved.memory) <= limit and moved.balance[0] < fastest.balance[0], moved
    want_loss, want = reference(model, x, y, nn.functional.mse_loss, 8)
    model.zero_grad(set_to_none=True)
    loss, stats = _step_on_plan(model, tight, x, y)
    for rank, s in stats.items():
        # the walk, as run (the last rank's loss keeps a few tensors it does not see)
        assert s["peak"] == pytest.approx(moved.memory[rank], rel=0.05), (rank, s)
    torch.testing.assert_close(loss, want_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)
    with pytest.raises(ValueError, match="no plan fits"):  # below any split's walk
        plan(model, x, 2, memory_limit=int(0.3 * max(fastest.memory)), schedules=["1f1b"],
             chunks=[8], checkpoints=["never"], prof=free.profile)


def test_the_planner_walks_what_w_gathers():
    """Microbatches of fewer rows than a Linear's gathering limit leave their
    W waiting in the stage's queue (``deferred.WeightQueue``): the planner's
    walk holds it as the executor books it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.Tanh())])
    x, y = torch.randn(512, 256), torch.randn(512, 256)  # 64 rows a microbatch, under 128
    made = plan(model, x, 2, schedules=["1f1b", "zb-h1", "zbv"], chunks=[8], checkpoints=["never"])
    assert {layer.gather_limit for layer in made.profile.layers} == {0, 128}
    for c in made.candidates:
        _, stats = _step_on_plan(model, type(made)(c, [c]), x, y)
        model.zero_grad(set_to_none=True)
        for rank, s in stats.items():
            # the loss's own saved tensors (on the last stage) are not the model's
            assert s["peak"] == pytest.approx(c.memory[rank], rel=0.05), (c.schedule, c.lean, rank)


def test_memory_stats_follow_checkpointing():
    torch.manual_seed(0)
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    peaks = {}
    for mode in ("never", "always"):
        pipe = Pipe(mlp(), chunks=4, schedule="gpipe", devices=["cpu", "cpu"], checkpoint=mode)
        try:
            pipe.step(x, y, nn.functional.mse_loss)
            peaks[mode] = pipe.memory_stats()
        finally:
            pipe.close()
    for rank in (0, 1):
        assert peaks["always"][rank]["activations_peak"] < peaks["never"][rank]["activations_peak"]
        assert peaks["never"][rank]["params"] == peaks["never"][rank]["grads"] > 0


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_auto_balance_by_time(schedule):
    model = nn.Sequential(_Busy(1, 5), _Busy(1, 5), _Busy(1, 5), _Busy(8, 5), nn.Linear(5, 3))
    model = model.double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    ref_model = nn.Sequential(*[m for m in model])
    pipe = Pipe(model, chunks=2, schedule=schedule, balance="auto", devices=["cpu", "cpu"],
                stages_per_rank=2 if schedule == "zbv" else None)
    try:
        loss = pipe.step(x, y, nn.functional.mse_loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        pipe.close()
    assert pipe.balance is not None and sum(pipe.balance) == 5
    if schedule == "1f1b":
        assert pipe.balance == [3, 2]  # the 8 ms layer goes with the cheap last one
    model.zero_grad()
    ref_loss, ref_grads = reference(ref_model, x, y, nn.functional.mse_loss, 2)
    torch.testing.assert_close(loss, ref_loss)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], msg=name)
    with pytest.raises(ValueError, match="'auto'"):
        Pipe(mlp(), chunks=2, balance="fast", devices=["cpu", "cpu"])


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes(1000) == 1000 and parse_bytes(None) is None
    for bad in ("2 parsecs", "GiB", -1, True):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_plan_cli_prints_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "fastpipe", "plan", "--model", "tests.models:mlp_deep", "--ranks", "2",
         "--input-shape", "16,5", "--memory-limit", "1MiB", "--top", "5"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "chosen" in out.stdout and "schedule" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "fastpipe", "plan", "--model", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "MODULE:FACTORY" in bad.stderr


def test_plan_cli_passes_the_loss_and_its_target(monkeypatch, capsys):
    """``--loss MODULE:FN`` with a factory's (model, sample, target): plan
    gets both; a loss without a target, or a factory's target without
    ``--loss``, as the help says."""
    import fastpipe._plan
    from fastpipe._cli import main
    from tests.models import lm_loss

    seen = {}
    real = fastpipe._plan.plan

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fastpipe._plan, "plan", spy)
    assert main(["plan", "--model", "tests.models:gpt_lm", "--loss", "tests.models:lm_loss",
                 "--top", "3"]) == 0
    assert seen["loss_fn"] is lm_loss and seen["target"].shape == (8, 8)
    assert "with tests.models:lm_loss" in capsys.readouterr().out
    assert main(["plan", "--model", "tests.models:gpt_lm", "--top", "1"]) == 0
    assert seen["loss_fn"] is None and seen["target"] is None  # no --loss: the loss left out
    for argv, message in [
        (["--model", "tests.models:mlp_deep", "--input-shape", "16,5", "--loss",
          "tests.models:lm_loss"], "--loss needs a target"),
        (["--model", "tests.models:gpt_lm", "--loss", "lm_loss"], "MODULE:FN"),
        (["--model", "tests.models:gpt_lm", "--loss", "tests.models:HF_VOCAB"], "not a function"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["plan", *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_the_cost_model_runs_b_as_i_and_a_gathered_w():
    """As the executor runs them (``fused_wgrad``): a B costs I and its share
    of W, not autograd's backward; a stage's W queue runs once per
    ``ceil(limit / rows)`` microbatches, so each B or W pays the part of W
    that grows with rows and the fixed part once per run; a queue that does
    not gather pays all of W every microbatch."""
    from fastpipe._plan import _cost_fn, _stage_sums
    from fastpipe.balance import LayerProfile, Profile
    from fastpipe.schedules import Action, Kind, build

    def layer(rows, limit):
        return LayerProfile(forward=1.0, backward=9.0, input_backward=2.0, weight_backward=1.5,
                            param_bytes=0, activation_bytes=0, output_bytes=0,
                            gather_rows=rows, gather_limit=limit)

    fit = {"forward": (0.0, 1.0), "backward": (0.0, 9.0), "input_backward": (0.0, 2.0),
           "weight_backward": (1.0, 0.5)}  # W: 1.0 fixed, 0.5 a row (1 row here)
    sched = build("1f1b", 2, 8)
    gathers = Profile((layer(16, 64), layer(16, 64)), rows=1, device="cpu", fits=(fit, fit))
    cost = _cost_fn(_stage_sums(gathers, [1, 1]), "never", 8, sched, 0.0)
    share = 0.5 + 1.0 * 2 / 8  # 4 microbatches a run: 2 runs in 8
    assert cost(Action(0, Kind.F, 3)) == 1.0
    assert cost(Action(0, Kind.B, 3)) == pytest.approx(2.0 + share)
    assert cost(Action(1, Kind.W, 0)) == pytest.approx(share)
    at_once = Profile((layer(0, 0), layer(0, 0)), rows=1, device="cpu", fits=(fit, fit))
    cost = _cost_fn(_stage_sums(at_once, [1, 1]), "never", 8, sched, 0.0)
    assert cost(Action(0, Kind.B, 3)) == pytest.approx(3.5)
    unfitted = Profile((layer(16, 64), layer(16, 64)), rows=1, device="cpu")
    cost = _cost_fn(_stage_sums(unfitted, [1, 1]), "never", 8, sched, 0.0)
    assert cost(Action(0, Kind.B, 3)) == pytest.approx(3.5)  # no fit: no fixed part known


def test_balance_for_a_v_is_no_slower_than_even_stages_or_even_ranks():
    """``balance_for`` simulates the schedule: its split's step is at most
    the shorter of even stages and even ranks, and one stage per rank is the
    plain partition."""
    from fastpipe._plan import _cost_fn, _stage_sums, balance_for
    from fastpipe.balance import LayerProfile, Profile
    from fastpipe.schedules import build

    def layer(t):
        return LayerProfile(t / 3, 2 * t / 3, t / 3, t / 3, 0, 0, 0)

    # embedding, six blocks, head: the shape of a GPT
    prof = Profile(tuple(layer(t) for t in (0.05, 1, 1, 1, 1, 1, 1, 0.8)), rows=1, device="cpu")
    costs = [x.forward + x.backward for x in prof.layers]
    for name in ("zbv", "dualpipev", "interleaved-1f1b"):
        sched = build(name, 2, 8, stages_per_rank=2)

        def step(bal):
            return sched.simulate(_cost_fn(_stage_sums(prof, bal), "never", 8, sched, 0.0)).makespan

        got = balance_for(prof, sched)
        assert sum(got) == 8 and len(got) == 4 and min(got) >= 1
        even = partition(costs, 4)
        by_rank = partition(costs, 4, owners=sched.stage_to_rank)
        assert step(got) <= min(step(even), step(by_rank)) + 1e-12, name
    one = build("1f1b", 2, 8)
    assert balance_for(prof, one) == partition(costs, 2)


def test_a_plan_runs_the_zero_bubble_order_its_costs_favour():
    """``ordered`` keeps the faster of the built-in order and the one for the
    costs; a plan that chose a reordered schedule hands Pipe that schedule."""
    from fastpipe._plan import Candidate, Plan, ordered
    from fastpipe.schedules import build

    built = build("zb-h1", 2, 8)
    cheap_w = {"F": 1.0, "I": 1.0, "W": 0.25}
    chosen, sim = ordered(built, lambda a: cheap_w[a.kind.value])
    assert chosen is not built and chosen.name == "zb-h1"
    assert sim.makespan < built.simulate(cheap_w).makespan
    one_f_one_b = build("1f1b", 2, 8)
    assert ordered(one_f_one_b, lambda a: 1.0)[0] is one_f_one_b  # a fixed order stays
    # Whatever the costs: never slower, never more in flight than the built-in order.
    rng = random.Random(0)
    for name, p, v in [("zb-h1", 3, 1), ("zb-h2", 3, 1), ("zbv", 2, 2), ("zbv", 3, 2)] * 10:
        table = {k: [rng.choice([0.1, 0.25, 0.5, 1.0, 2.0]) for _ in range(p * v)] for k in "FIW"}

        def cost(a, table=table):
            return table[a.kind.value][a.stage]

        fixed = build(name, p, 8, v)
        mine, sim = ordered(fixed, cost)
        before = fixed.simulate(cost)
        assert sim.makespan <= before.makespan
        assert all(a <= b for a, b in zip(sim.peak_inflight, before.peak_inflight))

    model = mlp()  # 6 layers, float64
    best = Candidate("zb-h1", 8, 1, (3, 3), "never", 0.01, 0.1, (1, 1), chosen)
    assert "zb-h1~" in Plan(best, [best]).explain()  # marked as ordered by the costs
    pipe = Pipe(model, plan=Plan(best, [best]), schedule="zb-h1", devices=["cpu", "cpu"])
    try:
        assert pipe.schedule is chosen
        x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
        loss = pipe.step(x, y, nn.functional.mse_loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        expected, want = reference(model, x, y, nn.functional.mse_loss, 8)
        torch.testing.assert_close(loss, expected)
        for n, g in grads.items():
            torch.testing.assert_close(g, want[n])
    finally:
        pipe.close()


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_auto_balance_orders_a_zero_bubble_schedule_by_the_measured_costs(schedule, monkeypatch):
    """balance="auto" with a zero-bubble name: where the profile's W is a
    quarter of F, the Pipe runs the order for those costs (the profile is
    made up here, so the choice does not depend on this machine's timing),
    with the unsplit model's gradients; a Schedule object of one's own, or
    1F1B, keeps its order."""
    import fastpipe.balance as balance_mod
    from fastpipe.balance import LayerProfile, Profile
    from fastpipe.schedules import build

    def cheap_w(model, sample, device="cpu", chunks=1, **_):
        layer = LayerProfile(1e-3, 1.25e-3, 1e-3, 0.25e-3, 100, 100, 100)
        return Profile(tuple(layer for _ in model), 1, "cpu")

    monkeypatch.setattr(balance_mod, "profile", cheap_w)
    spr = 2 if schedule == "zbv" else None
    model = mlp(depth=10)
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    pipe = Pipe(model, chunks=8, schedule=schedule, balance="auto", devices=["cpu", "cpu"],
                stages_per_rank=spr)
    built = pipe.schedule
    try:
        loss = pipe.step(x, y, nn.functional.mse_loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        pipe.close()
    assert pipe.schedule is not built and pipe.schedule.name == schedule
    assert pipe.schedule.actions != built.actions
    model.zero_grad()
    ref_loss, ref_grads = reference(model, x, y, nn.functional.mse_loss, 8)
    torch.testing.assert_close(loss, ref_loss)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], msg=name)
    for own in (build(schedule, 2, 8, spr, costs={"F": 1.0, "I": 1.0, "W": 0.5}), "1f1b"):
        pipe = Pipe(mlp(depth=10), chunks=8, schedule=own, balance="auto", devices=["cpu", "cpu"],
                    stages_per_rank=None if own == "1f1b" else spr)
        before = pipe.schedule
        try:
            pipe.step(x, y, nn.functional.mse_loss)
        finally:
            pipe.close()
        assert pipe.schedule is before
