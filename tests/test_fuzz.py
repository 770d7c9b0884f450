"""Random pipelines in local mode: every one reproduces the sequential gradients."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe import Pipe
from fastpipe.schedules import names
from tests.models import reference

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
