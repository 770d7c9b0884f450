"""Known losses: value and gradient without a graph, bit for bit autograd's,
and autograd wherever they could differ."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime import losses as losses_module
from fastpipe.runtime.losses import known_loss

F = nn.functional


def _autograd(loss_fn, out, target, scale):
    leaf = out.clone().requires_grad_()
    loss = loss_fn(leaf, target)
    loss.backward(torch.full_like(loss, scale))
    return loss.detach(), leaf.grad


def _case(kind, dtype, ignore=-100):
    torch.manual_seed(0)
    out = torch.randn(6, 5, dtype=dtype)
    if kind == "mse":
        return out, torch.randn(6, 5, dtype=dtype)
    target = torch.randint(0, 5, (6,))
    target[2] = ignore  # a row the loss leaves out
    return out, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss_fn, kind", [
    (F.mse_loss, "mse"), (nn.MSELoss(), "mse"), (nn.MSELoss(reduction="sum"), "mse"),
    (F.cross_entropy, "ce"), (nn.CrossEntropyLoss(), "ce"),
    (nn.CrossEntropyLoss(reduction="sum"), "ce"), (nn.CrossEntropyLoss(ignore_index=1), "ce"),
])
def test_known_losses_are_bit_identical_to_autograd(loss_fn, kind, dtype):
    out, target = _case(kind, dtype, getattr(loss_fn, "ignore_index", -100))
    known = known_loss(loss_fn)
    assert known is not None
    loss, grad = known.value_and_grad(out, target, 0.25)
    ref_loss, ref_grad = _autograd(loss_fn, out, target, 0.25)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


def _patched_module():
    loss = nn.MSELoss()
    loss.forward = lambda a, b: (a - b).abs().mean()
    return loss


def _hooked_module():
    loss = nn.MSELoss()
    loss.register_forward_hook(lambda *a: None)
    return loss


@pytest.mark.parametrize("loss_fn", [
    F.l1_loss, lambda a, b: F.mse_loss(a, b), nn.MSELoss(reduction="none"),
    nn.CrossEntropyLoss(label_smoothing=0.1), nn.CrossEntropyLoss(weight=torch.ones(5)),
    type("MyMSE", (nn.MSELoss,), {})(), _patched_module(), _hooked_module(), None,
])
def test_other_losses_keep_autograd(loss_fn):
    assert known_loss(loss_fn) is None


def test_a_patched_function_keeps_autograd(monkeypatch):
    monkeypatch.setattr(F, "mse_loss", lambda a, b, **k: (a - b).abs().mean())
    assert known_loss(F.mse_loss) is None
    assert known_loss(nn.MSELoss()) is None  # its forward calls the patch


@pytest.mark.parametrize("out, target", [
    (torch.randn(4, 3), torch.randn(4, 1)),  # broadcasts in autograd
    (torch.randn(4, 3), torch.randn(4, 3, dtype=torch.float64)),  # promotes
    (torch.randn(4, 3), torch.randn(4, 3).requires_grad_()),  # wants a gradient
])
def test_microbatches_mse_would_treat_differently_keep_autograd(out, target):
    assert known_loss(F.mse_loss).value_and_grad(out, target, 1.0) is None


@pytest.mark.parametrize("out, target", [
    (torch.randn(4, 3), torch.rand(4, 3)),  # class probabilities
    (torch.randn(4, 3, 2), torch.randint(0, 3, (4, 2))),  # more than 2-D
    (torch.randn(4, 3), torch.randint(0, 3, (4,), dtype=torch.int32)),
])
def test_microbatches_cross_entropy_would_treat_differently_keep_autograd(out, target):
    assert known_loss(F.cross_entropy).value_and_grad(out, target, 1.0) is None


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("loss_fn", [F.cross_entropy, nn.MSELoss(reduction="sum")])
def test_a_pipe_with_a_known_loss_matches_autograd(loss_fn, schedule, monkeypatch):
    """Through a Pipe whose last stage is a chain: the same losses and
    gradients as with the known-loss path turned off."""
    torch.manual_seed(1)
    x = torch.randn(8, 6, dtype=torch.float64)
    classes = loss_fn is F.cross_entropy
    y = torch.randint(0, 4, (8,)) if classes else torch.randn(8, 4, dtype=torch.float64)
    monkeypatch.setenv("FASTPIPE_CHAIN_GATHER", "0")
    used = []
    real = losses_module.KnownLoss.value_and_grad

    def counted(self, *args):
        used.append(1)
        return real(self, *args)

    monkeypatch.setattr(losses_module.KnownLoss, "value_and_grad", counted)
    results = []
    for on in (True, False):
        monkeypatch.setenv("FASTPIPE_KNOWN_LOSS", "1" if on else "0")
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(),
                              nn.Linear(8, 4)).double()
        pipe = Pipe(model, chunks=4, schedule=schedule, devices=["cpu", "cpu"])
        loss = pipe.step(x, y, loss_fn)
        results.append((loss, [p.grad.clone() for p in model.parameters()]))
    assert len(used) == 4  # every microbatch of the first run
    (la, ga), (lb, gb) = results
    assert torch.equal(la, lb)
    assert all(torch.equal(a, b) for a, b in zip(ga, gb))
