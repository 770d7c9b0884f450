"""Random pipelines in local mode: every one reproduces the sequential gradients."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe import Pipe
from fastpipe.schedules import names
from tests.models import Block, Detach, First, Fork, reference
from tests.support import spawn_ranks
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


def mixed_model(kinds: list[str], seed: int) -> nn.Sequential:
    """A Linear, the ``kinds`` in order, a Linear; float64, seeded."""
    torch.manual_seed(seed)
    layers = [nn.Linear(_D, _D)]
    for kind in kinds:
        layers += _KINDS[kind]()
    return nn.Sequential(*layers, nn.Linear(_D, _D)).double()


def _mixed_case(pick, ranks: int) -> dict:
    """A random mixed case on ``ranks`` ranks; ``pick(name, options)`` chooses
    each value (hypothesis's draw, or a seeded ``random.Random``)."""
    schedule = pick("schedule", names())
    v = FIXED_V.get(schedule) or pick("v", [1, 2])
    stages = ranks * v
    kinds = [pick("kind", sorted(_KINDS)) for _ in range(pick("layers", range(max(0, stages - 2), stages + 4)))]
    layers = len(mixed_model(kinds, 0))
    kinds += ["linear"] * max(0, stages - layers)
    layers = max(layers, stages)
    cuts: list[int] = []
    while len(cuts) < stages - 1:
        cut = pick("cut", range(1, layers))
        if cut not in cuts:
            cuts.append(cut)
    bounds = [0, *sorted(cuts), layers]
    chunks = pick("chunks", range(1, 6))
    return dict(schedule=schedule, ranks=ranks, v=v, kinds=kinds, chunks=chunks,
                balance=[b - a for a, b in zip(bounds, bounds[1:])],
                rows=pick("rows", range(chunks, chunks + 4)),
                checkpoint=pick("checkpoint", ["never", "always", "except_last"]),
                fused=pick("fused", [True, False]), input_grad=pick("input_grad", [False, True]),
                chains=pick("chains", ["1", "0"]), meta=pick("meta", [False, True]),
                seed=pick("seed", range(2**16)))


def mixed_case_data(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's input (wanting a gradient where ``input_grad``) and target."""
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["rows"], 3, _D, generator=g, dtype=torch.float64)
    y = torch.randn(case["rows"], 3, _D, generator=g, dtype=torch.float64)
    return x.requires_grad_(case["input_grad"]), y


def _expected(case: dict) -> list[tuple]:
    """(loss, grads, x.grad) of the unsplit model after each of two steps."""
    ref, (x, y) = mixed_model(case["kinds"], case["seed"]), mixed_case_data(case)
    out = []
    for _ in range(2):  # the second step adds to the first's gradients
        loss, grads = reference(ref, x, y, nn.functional.mse_loss, case["chunks"])
        out.append((loss, grads, None if x.grad is None else x.grad.clone()))
    return out


@st.composite
def mixed_pipelines(draw):
    return _mixed_case(lambda _, options: draw(st.sampled_from(list(options))),
                       draw(st.integers(1, 3)))


@settings(max_examples=200, deadline=None)
@given(mixed_pipelines())
def test_random_mixed_pipelines_match_sequential_over_two_steps(case):
    """Any split of mixed layers, any schedule, checkpointing, fused or
    autograd B, chains on or off: two steps' loss, ``.grad`` (None where the
    unsplit model leaves None) and the input's gradient; the model built on
    the meta device and loaded, or as it is."""
    with torch.device("meta") if case["meta"] else contextlib.nullcontext():
        model = mixed_model(case["kinds"], case["seed"])
    x, y = mixed_case_data(case)
    before = os.environ.get("FASTPIPE_CHAIN")
    os.environ["FASTPIPE_CHAIN"] = case["chains"]  # read when the Pipe is built
    try:
        pipe = Pipe(model, chunks=case["chunks"], schedule=case["schedule"], balance=case["balance"],
                    devices=["cpu"] * case["ranks"], stages_per_rank=case["v"],
                    checkpoint=case["checkpoint"], fused_wgrad=case["fused"])
    finally:
        if before is None:
            del os.environ["FASTPIPE_CHAIN"]
        else:
            os.environ["FASTPIPE_CHAIN"] = before
    try:
        if case["meta"]:
            pipe.load_state_dict(mixed_model(case["kinds"], case["seed"]).state_dict())
        got = []
        for _ in range(2):
            loss = pipe.step(x, y, nn.functional.mse_loss)
            got.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}, None if x.grad is None else x.grad.clone()))
    finally:
        pipe.close()
    _check_mixed(got, _expected(case))


def _check_mixed(got: list[tuple], expected: list[tuple]) -> None:
    for (loss, grads, x_grad), (loss_ref, grads_ref, x_grad_ref) in zip(got, expected, strict=True):
        torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=1e-12)
        assert grads.keys() == grads_ref.keys()
        for name, grad in grads_ref.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-11, msg=name)
        assert (x_grad is None) == (x_grad_ref is None)
        if x_grad is not None:
            torch.testing.assert_close(x_grad, x_grad_ref, rtol=1e-9, atol=1e-11)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_random_mixed_pipelines_on_two_ranks(tmp_path):
    """The mixed cases on two gloo ranks, over shared memory, gloo, lanes
    and exact (NCCL-style) messages: each rank's gradients together are
    the unsplit model's, and x.grad is stage 0's rank's only."""
    rng = random.Random(26)
    cases = []
    for i in range(48):
        case = _mixed_case(lambda _, options: rng.choice(list(options)), 2)
        cases.append({**case, "transport": ("shm", "gloo", "lanes", "exact")[i % 4]})
    results = spawn_ranks("tests._fuzz_worker", 2, cases, tmp_path)
    for i, case in enumerate(cases):
        merged = []
        for step in range(2):
            first, last = (r[i][step] for r in results)
            grads = {**first["grads"], **last["grads"]}
            assert len(grads) == len(first["grads"]) + len(last["grads"]), case  # each on one rank
            torch.testing.assert_close(first["loss"], last["loss"])
            assert last["x_grad"] is None  # stage 0 is rank 0's
            merged.append((first["loss"], grads, first["x_grad"]))
        _check_mixed(merged, _expected(case))
