"""fused_wgrad (the default): B's weight gradients deferred too, each Linear's one GEMM into .grad.

Every schedule must still reproduce the sequential gradients, whatever mix of
layers a stage holds; layers the fast path cannot take (hooks, a weight used
twice, addmm with alpha != 1) must take autograd's path, not lose gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime import deferred
from fastpipe.schedules import names
from tests.models import embedding_model, reference, tuple_model

F = nn.functional
SPR = {"interleaved-1f1b": 2, "looped-bfs": 2, "zbv": 2, "dualpipev": 2}


class Twice(nn.Module):
    """One Linear applied twice: its weight gets two contributions."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class Tied(nn.Module):
    """A Linear whose weight is also used outside the Linear (a penalty)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x) + self.lin.weight.pow(2).sum() * 0.01


class ScaledAddmm(nn.Module):
    """addmm with alpha = 2: not a plain Linear, must not be fused."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) * 0.3)
        self.b = nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x):
        return torch.addmm(self.b, x, self.w.t(), alpha=2.0)


def mixed(dtype=torch.float64, seed=0):
    """Linears with and without bias, a 3-D Linear input, norms, a reused
    Linear, a weight also used outside its Linear and an addmm that is not
    a Linear, spread over the stages."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 8, bias=False), nn.LayerNorm(8),
        Twice(8), nn.Unflatten(1, (2, 4)), nn.Linear(4, 4), nn.Flatten(1), ScaledAddmm(8),
        nn.Tanh(), Tied(8), nn.Linear(8, 8), nn.Linear(8, 3),
    ).to(dtype)


def _check(model_fn, x, y, schedule, ranks=2, chunks=4, balance=None, rtol=1e-10, atol=1e-12):
    ref = model_fn()
    ref_loss, ref_grads = reference(ref, x, y, F.mse_loss, chunks)
    model = model_fn()
    pipe = Pipe(model, chunks=chunks, schedule=schedule, balance=balance, devices=["cpu"] * ranks,
                stages_per_rank=SPR.get(schedule), fused_wgrad=True)
    try:
        for step in range(2):  # the second step accumulates into existing .grad
            loss = pipe.step(x, y, F.mse_loss)
            torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, ref_grads[name] * (step + 1), rtol=rtol,
                                           atol=atol, msg=f"{schedule} step {step}: {name}")
    finally:
        pipe.close()


@pytest.fixture
def count_native(monkeypatch):
    """The Linears whose weight gradient W accumulated with one GEMM into
    .grad (deferred entries run fused: fastpipe.runtime.deferred; a chain
    stage's I makes such entries too)."""
    seen = []
    real = deferred.run_weight

    def counted(entries, fuse=True, calls=()):
        if fuse:
            seen.extend((e.params[0], e) for e in entries if isinstance(e.rule, deferred.LinearRule))
            seen.extend((w, c) for c in calls for w in c.weights)  # a native chain's Linears
        return real(entries, fuse, calls)

    monkeypatch.setattr(deferred, "run_weight", counted)
    return seen


@pytest.mark.parametrize("schedule", names())
def test_every_schedule_matches_sequential_fp64(schedule, count_native):
    torch.manual_seed(1)
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64)
    _check(mixed, x, y, schedule)
    assert count_native  # the fast path ran


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2", "zbv"])
def test_fp32_tolerance_and_four_ranks(schedule):
    torch.manual_seed(2)
    x, y = torch.randn(16, 5), torch.randn(16, 3)
    _check(lambda: mixed(torch.float32), x, y, schedule, ranks=4 if schedule != "zbv" else 2,
           chunks=8, rtol=1e-5, atol=4e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_embedding_and_tuple_models(schedule):
    torch.manual_seed(3)
    ids, y = torch.randint(0, 11, (6, 4)), torch.randn(6, 4, 3, dtype=torch.float64)
    _check(embedding_model, ids, y, schedule, chunks=3)
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    _check(tuple_model, x, y, schedule, chunks=3, balance=[2, 4])


def test_a_weight_with_a_tensor_hook_keeps_autograd_path(count_native):
    torch.manual_seed(4)
    calls = []

    def model_fn():
        m = mixed()
        m[0].weight.register_hook(lambda g: calls.append(1) or g * 1.0)
        return m

    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    _check(model_fn, x, y, "1f1b")
    assert calls  # the hook ran: the stage holding it took the plain backward
    stage0 = {id(p) for p in mixed()[0].parameters()}
    assert not any(id(weight) in stage0 for weight, _ in count_native)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_hooks_on_an_accumulate_grad_node_keep_the_stages_autograd_backward(schedule, count_native):
    """DDP-style hooks on a parameter's AccumulateGrad node run only where
    autograd accumulates: the stage holding it keeps autograd's backward
    (all of it in I under a split schedule); the other stage defers."""
    torch.manual_seed(5)
    fired, models, nodes = [], [], []

    def model_fn():
        m = mixed()
        node = m[0].weight.expand_as(m[0].weight).grad_fn.next_functions[0][0]
        n = len(models)
        node.register_hook(lambda *args: fired.append(n))
        models.append(m)
        nodes.append(node)  # the node lives while something holds it, as DDP holds its own
        return m

    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    _check(model_fn, x, y, schedule)
    assert fired.count(1) == 2 * 4  # the pipe's model: 2 steps of 4 microbatches
    assert count_native and not any(w is models[1][0].weight for w, _ in count_native)


def test_fused_wgrad_is_the_default_and_false_keeps_autograds_backward(count_native):
    torch.manual_seed(7)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    model = mixed()
    pipe = Pipe(model, chunks=4, schedule="1f1b", devices=["cpu", "cpu"])
    plain = Pipe(mixed(), chunks=4, schedule="1f1b", devices=["cpu", "cpu"], fused_wgrad=False)
    try:
        assert pipe.fused_wgrad and not plain.fused_wgrad
        plain.step(x, y, F.mse_loss)
        assert not count_native
        pipe.step(x, y, F.mse_loss)
        assert count_native
    finally:
        pipe.close()
        plain.close()


def test_bfloat16_takes_torch_ops(count_native):
    torch.manual_seed(6)
    x, y = torch.randn(8, 5, dtype=torch.bfloat16), torch.randn(8, 3, dtype=torch.bfloat16)
    _check(lambda: mixed(torch.bfloat16), x, y, "zb-h1", rtol=0.05, atol=0.05)


def test_bad_flag_is_refused():
    with pytest.raises(TypeError, match="fused_wgrad must be a bool, got str"):
        Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2, devices=["cpu", "cpu"],
             fused_wgrad="yes")
