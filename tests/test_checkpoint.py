"""Stage checkpointing: same gradients, dropout replayed, nothing saved in forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe import Pipe
from fastpipe.runtime.checkpoint import checkpointed
from fastpipe.runtime.executor import RankExecutor, Stage
from fastpipe.runtime.transport import LocalTransport, Mailbox
from fastpipe.schedules import build, lower
from tests.models import mlp, tuple_model

F = nn.functional
SPR = {"zbv": 2, "interleaved-1f1b": 2}


def _grads(model_fn, schedule, checkpoint, ranks=2, chunks=4, seed=None):
    model = model_fn()
    torch.manual_seed(3)
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64)
    pipe = Pipe(model, chunks=chunks, schedule=schedule, devices=["cpu"] * ranks,
                stages_per_rank=SPR.get(schedule), checkpoint=checkpoint)
    try:
        if seed is not None:
            torch.manual_seed(seed)
        loss = pipe.step(x, y, F.mse_loss)
    finally:
        pipe.close()
    return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zbv", "interleaved-1f1b"])
@pytest.mark.parametrize("mode", ["except_last", "always"])
@pytest.mark.parametrize("model_fn", [mlp, tuple_model])
def test_grads_equal_the_unchekpointed_run_exactly(schedule, mode, model_fn, monkeypatch):
    # Checkpointed microbatches run through autograd, whose W adds one
    # microbatch at a time: so does the chain run compared with, here.
    monkeypatch.setenv("FASTPIPE_CHAIN_GATHER", "0")
    loss, grads = _grads(model_fn, schedule, "never")
    ck_loss, ck_grads = _grads(model_fn, schedule, mode)
    assert torch.equal(loss, ck_loss)
    for name in grads:
        assert torch.equal(grads[name], ck_grads[name]), name


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_checkpointed_chain_stage_leaves_its_weight_gradients_to_w(mode, monkeypatch):
    """A chain stage's checkpointed microbatches run through autograd, and
    their layers still defer: W, not I, computes every Linear's gradient."""
    from fastpipe.runtime import deferred

    ran = []
    run_weight = deferred.run_weight

    def counting(entries, fuse=True, calls=()):
        ran.append(len(entries) + sum(len(c) for c in calls))
        return run_weight(entries, fuse, calls)

    monkeypatch.setattr(deferred, "run_weight", counting)
    _grads(mlp, "zb-h1", mode)
    assert sum(ran) == 4 * 4  # four Linears, four microbatches


def _dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.3),
        nn.Linear(16, 3),
    ).double()


@pytest.mark.parametrize("mode", ["except_last", "always"])
def test_dropout_is_replayed_in_one_rank(mode):
    # One rank runs its microbatches in a fixed order, so the unchekpointed
    # run draws the same masks: the grads must match bit for bit.
    loss, grads = _grads(_dropout_model, "1f1b", "never", ranks=1, seed=11)
    ck_loss, ck_grads = _grads(_dropout_model, "1f1b", mode, ranks=1, seed=11)
    assert torch.equal(loss, ck_loss)
    for name in grads:
        assert torch.equal(grads[name], ck_grads[name]), name


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_seeded_dropout_repeats_across_local_ranks(schedule, monkeypatch):
    """Local ranks are threads sharing the CPU generator: a seeded step draws
    the same masks whatever order they ran in (three runs alike, bit for
    bit), with and without checkpointing, and as GPipe's order draws them
    (each forward has its own seed)."""
    monkeypatch.setenv("FASTPIPE_CHAIN_GATHER", "0")  # as above
    runs = [_grads(_dropout_model, schedule, mode, seed=11) for mode in ("never",) * 3 + ("always",)]
    if schedule != "zbv":  # the same two stages: masks do not depend on the order either
        runs.append(_grads(_dropout_model, "gpipe", "never", seed=11))
    loss, grads = runs[0]
    for other_loss, other in runs[1:]:
        assert torch.equal(loss, other_loss)
        for name in grads:
            assert torch.equal(grads[name], other[name]), name


def test_which_layers_count_as_random():
    """Stages with these hold the ranks' lock and get their own seeds; a
    checkpointed stage without them keeps no random state to replay."""
    from fastpipe.kernels import SeededDropout
    from fastpipe.runtime.checkpoint import stochastic

    class Custom(nn.Module):
        draws_random = True

    assert stochastic(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
    assert stochastic(nn.Sequential(SeededDropout(0.1))) and stochastic(nn.Sequential(nn.RReLU()))
    assert stochastic(nn.Sequential(Custom()))
    assert not stochastic(nn.Sequential(nn.Linear(2, 2), nn.Tanh()))
    assert not stochastic(nn.Sequential(nn.Dropout(0.1)).eval(), training_only=True)


class _MaskLog(nn.Module):
    """Dropout that logs its mask, tagged with whether it runs in a recomputation."""

    def __init__(self, log):
        super().__init__()
        self.log, self.inner = log, nn.Dropout(0.5)

    def forward(self, x):
        out = self.inner(x)
        self.log.append((fastpipe.is_recomputing(), x.shape, (out != 0).clone()))
        return out


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_two_local_ranks_replay_their_masks(schedule):
    """Ranks are concurrent threads: each recomputation must still see its forward's mask."""
    logs = [[], [], [], []]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 8), _MaskLog(logs[0]), nn.Linear(8, 8), _MaskLog(logs[1]),
        nn.Linear(8, 8), _MaskLog(logs[2]), nn.Linear(8, 3), _MaskLog(logs[3]),
    ).double()
    pipe = Pipe(model, chunks=4, schedule=schedule, devices=["cpu", "cpu"],
                stages_per_rank=SPR.get(schedule), checkpoint="always",
                balance=[2, 2, 2, 2] if schedule == "zbv" else [4, 4])
    try:
        pipe.step(torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64), F.mse_loss)
    finally:
        pipe.close()
    for log in logs:
        first = [mask for again, _, mask in log if not again]
        again = [mask for again, _, mask in log if again]
        assert len(first) == len(again) == 4
        # Stages run their microbatches in order, in forward and in backward.
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def _saved_bytes_outside_recompute(mode: str) -> tuple[int, int]:
    """(bytes autograd saved in forward, bytes it saved while recomputing), one rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh()).double()
    stage = Stage(0, model, torch.device("cpu"))
    schedule = lower(build("gpipe", 1, 4))
    ex = RankExecutor(0, schedule, {0: stage}, LocalTransport(Mailbox(), 0, [stage.device], 5), mode)
    counts = [0, 0]

    def pack(t):
        if not isinstance(t, nn.Parameter):
            counts[fastpipe.is_recomputing()] += t.numel() * t.element_size()
        return t

    x = [torch.randn(3, 6, dtype=torch.float64) for _ in range(4)]
    y = [torch.randn(3, 32, dtype=torch.float64) for _ in range(4)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ex.run(x, y, F.mse_loss, train=True)
    return counts[0], counts[1]


def test_checkpointed_forward_saves_no_activation():
    never = _saved_bytes_outside_recompute("never")
    always = _saved_bytes_outside_recompute("always")
    last_only = _saved_bytes_outside_recompute("except_last")
    assert never[0] > 0 and never[1] == 0
    assert always[0] == 0 and always[1] == never[0]
    assert last_only[0] * 4 == never[0]  # only the last of 4 microbatches
    assert last_only[1] * 4 == never[0] * 3


def test_side_effects_can_skip_the_recomputation():
    class Counter(nn.Module):
        calls = 0

        def forward(self, x):
            if not fastpipe.is_recomputing():
                Counter.calls += 1
            return x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), Counter(), nn.Linear(4, 3)).double()
    pipe = Pipe(model, chunks=4, schedule="1f1b", devices=["cpu", "cpu"], checkpoint="always")
    try:
        pipe.step(torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64), F.mse_loss)
    finally:
        pipe.close()
    assert Counter.calls == 4
    assert not fastpipe.is_recomputing()


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_recomputation_leaves_running_statistics_as_the_forward_did(schedule):
    # A checkpointed BatchNorm's recomputation would update its running
    # statistics a second time; they must be the unsplit loop's, whatever the
    # momentum (None: a cumulative average through num_batches_tracked).
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(),
                             nn.Conv1d(4, 4, 3, padding=1), nn.BatchNorm1d(4, momentum=None),
                             nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
                             nn.Flatten(), nn.Linear(4 * 6, 3)).double()

    torch.manual_seed(1)
    x, y = torch.randn(8, 3, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    model, ref = build(), build()
    pipe = Pipe(model, chunks=4, schedule=schedule, devices=["cpu", "cpu"],
                stages_per_rank=SPR.get(schedule), checkpoint="always")
    try:
        for _ in range(2):
            pipe.step(x, y, F.mse_loss)
    finally:
        pipe.close()
    for _ in range(2):
        sum(F.mse_loss(ref(a), b) for a, b in zip(x.tensor_split(4), y.tensor_split(4))).backward()
    for (name, b), (_, r) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, r, rtol=1e-12, atol=1e-12, msg=name)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad / 4, rtol=1e-10, atol=1e-12, msg=name)


def test_modes():
    assert [checkpointed("except_last", i, 4) for i in range(4)] == [True, True, True, False]
    assert all(checkpointed("always", i, 4) for i in range(4))
    assert not any(checkpointed("never", i, 4) for i in range(4))


@pytest.mark.parametrize("bad", ["sometimes", None, 1, "Always"])
def test_bad_mode_names_the_value(bad):
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        Pipe(mlp(), chunks=2, devices=["cpu", "cpu"], checkpoint=bad)
