"""Memory-saving layers: Triton kernels (interpreter) vs torch reference vs plain layers."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

from bench.recompute import mlp_block, pre_ln_mlp
from fastpipe.kernels import (
    ActLinear, GeGLU, LayerNorm, RMSNorm, SeededDropout, SwiGLU, backend, selective_recompute,
)
from fastpipe.runtime.memory import saved_activation_bytes
from fastpipe.kernels._triton import store
from fastpipe.kernels.activation import (
    ACTIVATIONS, act_backward_torch, act_backward_triton, act_forward_torch, act_forward_triton,
)
from fastpipe.kernels.dropout import dropout_torch, dropout_triton, keep_mask
from fastpipe.kernels.gated import (
    gated_backward_torch, gated_backward_triton, gated_forward_torch, gated_forward_triton,
)
from fastpipe.kernels.norm import (
    norm_backward_torch, norm_backward_triton, norm_forward_torch, norm_forward_triton,
)

# The interpreter evaluates exp() in numpy: tanh-GELU overflows to inf for large
# |h| on the way to the right limit.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

COLS = [1, 7, 131, 4099]
# (dtype, atol, rtol): the interpreter is faithful for these once kernels
# compute in fp32 and round bf16 explicitly.
DTYPES = [(torch.float32, 1e-6, 1e-5), (torch.float16, 1e-3, 1e-3), (torch.bfloat16, 1e-2, 1e-2)]


def _close(a, b, atol, rtol):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_activation_kernels_match_reference(activation, cols, dtype, atol, rtol):
    torch.manual_seed(cols)
    h = (torch.randn(3, cols) * 3).to(dtype)
    da = torch.randn(3, cols).to(dtype)
    _close(act_forward_triton(h, activation), act_forward_torch(h, activation), atol, rtol)
    dh, a = act_backward_triton(h, da, activation)
    ref_dh, ref_a = act_backward_torch(h, da, activation)
    _close(a, ref_a, atol, rtol)
    _close(dh, ref_dh, atol * 10, rtol)


@triton.jit
def _to_bf16_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    store(Y + offs, tl.load(X + offs, mask=mask), mask, True)


def test_bf16_stores_round_to_nearest_even():
    # Ties and near-ties around bf16 neighbours, where truncation (the
    # interpreter's own cast) would be off by one ulp.
    base = torch.tensor([1.0, -3.0, 1e-3, 7e4])
    ulp = 2.0 ** -8
    x = torch.cat([base * (1 + k * ulp / 4) for k in range(8)] + [torch.randn(100)])
    y = torch.empty_like(x, dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](x, y, x.numel(), BLOCK=256)
    assert torch.equal(y, x.to(torch.bfloat16))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_act_linear_matches_plain_layers(impl, activation):
    torch.manual_seed(0)
    plain_act = {"relu": nn.ReLU(), "silu": nn.SiLU(), "gelu": nn.GELU(),
                 "gelu_tanh": nn.GELU(approximate="tanh")}[activation]
    linear = nn.Linear(131, 7)
    fused = ActLinear.from_linear(activation, linear)
    assert fused.weight is linear.weight and fused.bias is linear.bias
    x = torch.randn(5, 3, 131, requires_grad=True)
    dy = torch.randn(5, 3, 7)
    ref = linear(plain_act(x))
    ref_grads = torch.autograd.grad(ref, [x, linear.weight, linear.bias], dy)
    with backend(impl):
        out = fused(x)
        grads = torch.autograd.grad(out, [x, fused.weight, fused.bias], dy)
    tol = {"atol": 0, "rtol": 0} if impl == "torch" else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_gated_kernels_match_reference(activation, cols, dtype, atol, rtol):
    torch.manual_seed(cols)
    x = torch.randn(3, 2 * cols).to(dtype)
    dy = torch.randn(3, cols).to(dtype)
    _close(gated_forward_triton(x, activation), gated_forward_torch(x, activation), atol, rtol)
    _close(gated_backward_triton(x, dy, activation), gated_backward_torch(x, dy, activation), atol * 10, rtol)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("module,act", [(SwiGLU(), F.silu), (GeGLU(), F.gelu),
                                         (GeGLU("tanh"), lambda g: F.gelu(g, approximate="tanh"))])
def test_gated_modules_match_plain(impl, module, act):
    torch.manual_seed(1)
    x = torch.randn(4, 2 * 33, requires_grad=True)
    dy = torch.randn(4, 33)
    gate, up = x.chunk(2, -1)
    ref = act(gate) * up
    (ref_dx,) = torch.autograd.grad(ref, x, dy)
    with backend(impl):
        out = module(x)
        (dx,) = torch.autograd.grad(out, x, dy)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dx, ref_dx, atol=1e-6, rtol=1e-5)


def test_gated_needs_an_even_last_dimension():
    with pytest.raises(ValueError, match="even"):
        SwiGLU()(torch.randn(2, 5))


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_dropout_kernel_regenerates_the_reference_mask(cols, dtype, atol, rtol):
    x = torch.randn(3, cols).to(dtype)
    for seed in (0, 2**33 + 5):
        a, b = dropout_triton(x, seed, 0.25), dropout_torch(x, seed, 0.25)
        assert torch.equal(a == 0, b == 0)  # the same mask, bit for bit
        _close(a, b, atol, rtol)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_seeded_dropout_backward_uses_the_forward_mask(impl):
    torch.manual_seed(0)
    drop = SeededDropout(0.4)
    x = torch.randn(64, 65, requires_grad=True)
    with backend(impl):
        y = drop(x)
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    kept = y != 0
    assert 0.3 < 1 - kept.float().mean().item() < 0.5
    torch.testing.assert_close(dx, kept.float() / 0.6)
    torch.testing.assert_close(y[kept], x[kept] / 0.6)


def test_seeded_dropout_follows_manual_seed_and_eval():
    drop = SeededDropout(0.5)
    x = torch.randn(100)
    torch.manual_seed(3)
    a = drop(x)
    torch.manual_seed(3)
    b = drop(x)
    assert torch.equal(a, b)
    assert torch.equal(drop.eval()(x), x)
    for bad in (1.0, -0.1, "0.5"):
        with pytest.raises(ValueError, match="dropout probability"):
            SeededDropout(bad)


def test_keep_mask_is_philox_uniform():
    mask = keep_mask(torch.Size([200_000]), seed=7, p=0.1, device="cpu")
    assert abs(mask.float().mean().item() - 0.9) < 0.005


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_norm_kernels_match_reference(rms, cols, dtype, atol, rtol):
    torch.manual_seed(cols)
    x = (torch.randn(3, cols) * 2 + 0.5).to(dtype)
    w, b = torch.randn(cols).to(dtype), torch.randn(cols).to(dtype)
    dy = torch.randn(3, cols).to(dtype)
    bias = None if rms else b
    y, rstd = norm_forward_triton(x, w, bias, 1e-5, rms)
    ref_y, ref_rstd = norm_forward_torch(x, w, bias, 1e-5, rms)
    _close(y, ref_y, atol * 10, rtol * 10)
    torch.testing.assert_close(rstd, ref_rstd, atol=1e-5, rtol=1e-4)
    _close(norm_backward_triton(x, w, dy, rstd, rms), norm_backward_torch(x, w, dy, ref_rstd, rms),
           atol * 20, rtol * 10)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("plain", [nn.LayerNorm(131), nn.LayerNorm(7, elementwise_affine=False),
                                   nn.RMSNorm(131), nn.RMSNorm(33, eps=1e-3)])
def test_norm_modules_match_plain(impl, plain):
    torch.manual_seed(2)
    if plain.weight is not None:
        with torch.no_grad():
            plain.weight.normal_()
    cls = RMSNorm if isinstance(plain, nn.RMSNorm) else LayerNorm
    ours = cls.from_module(plain)
    n = plain.normalized_shape[0]
    x = torch.randn(2, 5, n, requires_grad=True)
    dy = torch.randn(2, 5, n)
    params = [p for p in plain.parameters()]
    ref = plain(x)
    ref_grads = torch.autograd.grad(ref, [x, *params], dy)
    with backend(impl):
        out = ours(x)
        grads = torch.autograd.grad(out, [x, *params], dy)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("make,target", [(mlp_block, 0.40), (pre_ln_mlp, 0.30)])
def test_saved_activation_bytes_targets(make, target):
    x = torch.randn(16, 64, requires_grad=True)
    plain = saved_activation_bytes(make(), x)
    ours = saved_activation_bytes(selective_recompute(make()), x)
    assert ours <= (1 - target) * plain, (ours, plain)


def test_selective_recompute_keeps_numerics_and_parameters():
    plain = mlp_block()
    model = mlp_block()
    before = dict(model.named_parameters())
    assert selective_recompute(model) is model
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    x = torch.randn(8, 64)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    plain(x).square().mean().backward()
    model(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_selective_recompute_leaves_other_layers_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.GELU(), nn.Conv1d(1, 1, 1))
    selective_recompute(model)
    assert [type(m).__name__ for m in model] == ["Linear", "Tanh", "Linear", "GELU", "Conv1d"]
    with pytest.raises(TypeError, match="nn.Module"):
        selective_recompute("model")


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "zb-h1"])
def test_pipe_selective_recompute_matches_plain_pipeline(schedule):
    from fastpipe import Pipe

    def model():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.SiLU(),
            nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3),
        ).double()

    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    spr = 2 if schedule == "zbv" else None
    grads = []
    for recompute in ("none", "selective"):
        m = model()
        pipe = Pipe(m, chunks=4, schedule=schedule, devices=["cpu", "cpu"], stages_per_rank=spr,
                    recompute=recompute)
        try:
            loss = pipe.step(x, y, F.mse_loss)
        finally:
            pipe.close()
        grads.append((loss, {n: p.grad for n, p in m.named_parameters()}))
    assert any(isinstance(layer, ActLinear) for layer in m)
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-12, atol=1e-12)
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_pipe_rejects_an_unknown_recompute_mode():
    from fastpipe import Pipe

    with pytest.raises(ValueError, match="recompute must be"):
        Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2, devices=["cpu", "cpu"],
             recompute="all")
