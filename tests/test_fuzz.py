"""Random pipelines in local mode: every one reproduces the sequential gradients."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe import Pipe
from fastpipe.schedules import names
from tests.models import Block, Detach, First, Fork, reference
from tests.test_fused_wgrad import Twice

FIXED_V = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "zb-h2": 1, "zbv": 2, "dualpipev": 2}


@st.composite
def pipelines(draw):
    schedule = draw(st.sampled_from(names()))
    ranks = draw(st.integers(1, 4))
    v = FIXED_V.get(schedule) or draw(st.integers(1, 3))
    stages = ranks * v
    layers = stages + draw(st.integers(0, 3))
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1))) \
        if stages > 1 else []
    bounds = [0, *cuts, layers]
    balance = [b - a for a, b in zip(bounds, bounds[1:])]
    chunks = draw(st.integers(1, 6))
    rows = draw(st.integers(chunks, chunks + 3))  # uneven microbatches too
    seed = draw(st.integers(0, 2**16))
    return schedule, ranks, v, balance, chunks, rows, seed


def _model(layers: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    body = [nn.Tanh() if i % 3 == 2 else nn.Linear(3, 3) for i in range(layers)]
    return nn.Sequential(*body).double()


@settings(max_examples=500, deadline=None)
@given(pipelines())
def test_random_pipelines_match_sequential(case):
    schedule, ranks, v, balance, chunks, rows, seed = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, generator=g, dtype=torch.float64)
    y = torch.randn(rows, 3, generator=g, dtype=torch.float64)
    ref_loss, ref_grads = reference(_model(sum(balance), seed), x, y, nn.functional.mse_loss, chunks)
    model = _model(sum(balance), seed)
    pipe = Pipe(model, chunks=chunks, schedule=schedule, balance=balance, devices=["cpu"] * ranks,
                stages_per_rank=v)
    try:
        loss = pipe.step(x, y, nn.functional.mse_loss)
    finally:
        pipe.close()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for name, p in model.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


# Layers of the mixed fuzz (width 4, inputs (rows, 3, 4)): kinds with and
# without a weight rule, a block with attention, a Linear called twice, a
# tuple whose second member nobody reads (Fork, First), a detach.
_D = 4
_KINDS = {
    "linear": lambda: [nn.Linear(_D, _D)], "tanh": lambda: [nn.Tanh()],
    "layernorm": lambda: [nn.LayerNorm(_D)], "rmsnorm": lambda: [nn.RMSNorm(_D)],
    "gelu": lambda: [nn.GELU()], "block": lambda: [Block(_D, 2)], "twice": lambda: [Twice(_D)],
    "fork": lambda: [Fork(_D), First()], "detach": lambda: [Detach()],
}


def _mixed(kinds: list[str], seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(_D, _D)]
    for kind in kinds:
        layers += _KINDS[kind]()
    return nn.Sequential(*layers, nn.Linear(_D, _D)).double()


@st.composite
def mixed_pipelines(draw):
    schedule = draw(st.sampled_from(names()))
    ranks = draw(st.integers(1, 3))
    v = FIXED_V.get(schedule) or draw(st.integers(1, 2))
    stages = ranks * v
    kinds = draw(st.lists(st.sampled_from(sorted(_KINDS)), min_size=max(0, stages - 2),
                          max_size=stages + 3))
    layers = len(_mixed(kinds, 0))
    kinds += ["linear"] * max(0, stages - layers)
    layers = max(layers, stages)
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1))) \
        if stages > 1 else []
    bounds = [0, *cuts, layers]
    balance = [b - a for a, b in zip(bounds, bounds[1:])]
    chunks = draw(st.integers(1, 5))
    return dict(schedule=schedule, ranks=ranks, v=v, kinds=kinds, balance=balance, chunks=chunks,
                rows=draw(st.integers(chunks, chunks + 3)),
                checkpoint=draw(st.sampled_from(["never", "always", "except_last"])),
                fused=draw(st.booleans()), input_grad=draw(st.booleans()),
                chains=draw(st.sampled_from(["1", "0"])), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=200, deadline=None)
@given(mixed_pipelines())
def test_random_mixed_pipelines_match_sequential_over_two_steps(case):
    """Any split of mixed layers, any schedule, checkpointing, fused or
    autograd B, chains on or off: two steps' loss, ``.grad`` (None where the
    unsplit model leaves None) and the input's gradient."""
    g = torch.Generator().manual_seed(case["seed"])
    rows, chunks = case["rows"], case["chunks"]
    x0 = torch.randn(rows, 3, _D, generator=g, dtype=torch.float64)
    y = torch.randn(rows, 3, _D, generator=g, dtype=torch.float64)
    ref, ref_x = _mixed(case["kinds"], case["seed"]), x0.clone().requires_grad_(case["input_grad"])
    expected = []
    for _ in range(2):  # the second step adds to the first's gradients
        loss, grads = reference(ref, ref_x, y, nn.functional.mse_loss, chunks)
        expected.append((loss, grads, None if ref_x.grad is None else ref_x.grad.clone()))
    model, x = _mixed(case["kinds"], case["seed"]), x0.clone().requires_grad_(case["input_grad"])
    before = os.environ.get("FASTPIPE_CHAIN")
    os.environ["FASTPIPE_CHAIN"] = case["chains"]
    try:
        pipe = Pipe(model, chunks=chunks, schedule=case["schedule"], balance=case["balance"],
                    devices=["cpu"] * case["ranks"], stages_per_rank=case["v"],
                    checkpoint=case["checkpoint"], fused_wgrad=case["fused"])
    finally:
        if before is None:
            del os.environ["FASTPIPE_CHAIN"]
        else:
            os.environ["FASTPIPE_CHAIN"] = before
    try:
        for loss_ref, grads, x_grad in expected:
            loss = pipe.step(x, y, nn.functional.mse_loss)
            torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=1e-12)
            assert {n for n, p in model.named_parameters() if p.grad is not None} == grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-9,
                                           atol=1e-11, msg=name)
            if x_grad is None:
                assert x.grad is None
            else:
                torch.testing.assert_close(x.grad, x_grad, rtol=1e-9, atol=1e-11)
    finally:
        pipe.close()
