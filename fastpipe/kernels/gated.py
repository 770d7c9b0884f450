"""Gated MLP activations, SwiGLU and GeGLU, that save their two inputs only.

``x[..., 2H]`` splits into ``gate, up = x[..., :H], x[..., H:]`` and the
output is ``act(gate) * up``. Plain PyTorch saves ``gate``, ``up`` and
``act(gate)``; these layers save ``x`` (that is, gate and up) and recompute
``act(gate)`` in backward:

    dgate = dy · up · act'(gate)        dup = dy · act(gate)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

from fastpipe.kernels._dispatch import use_triton
from fastpipe.kernels._triton import BLOCK, block, grid1d, is_bf16, on_tensor_device, store
from fastpipe.kernels.activation import _CODE, _act_and_grad

__all__ = [
    "GatedFunction", "GeGLU", "SwiGLU", "gated_backward_torch", "gated_backward_triton",
    "gated_forward_torch", "gated_forward_triton",
]


@triton.jit
def _gated_fwd_kernel(
    X,
    Y,
    N,
    H,
    ACT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs, mask = block(N, BLOCK)
    row, col = offs // H, offs % H
    gate = tl.load(X + row * 2 * H + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * 2 * H + H + col, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(gate, ACT)
    store(Y + offs, a * up, mask, OUT_BF16)


@triton.jit
def _gated_bwd_kernel(
    X,
    DY,
    DX,
    N,
    H,
    ACT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs, mask = block(N, BLOCK)
    row, col = offs // H, offs % H
    g_at, u_at = row * 2 * H + col, row * 2 * H + H + col
    gate = tl.load(X + g_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + u_at, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(gate, ACT)  # act(gate) recomputed here
    store(DX + g_at, dy * up * da, mask, OUT_BF16)
    store(DX + u_at, dy * a, mask, OUT_BF16)


def _check(x: torch.Tensor) -> int:
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even (gate and up halves), got {tuple(x.shape)}")
    return x.shape[-1] // 2


@on_tensor_device
def gated_forward_triton(x: torch.Tensor, activation: str) -> torch.Tensor:
    h = _check(x)
    x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], h))
    n = y.numel()
    _gated_fwd_kernel[grid1d(n)](x, y, n, h, ACT=_CODE[activation], OUT_BF16=is_bf16(x), BLOCK=BLOCK)
    return y


@on_tensor_device
def gated_backward_triton(x: torch.Tensor, dy: torch.Tensor, activation: str) -> torch.Tensor:
    h = _check(x)
    x, dy = x.contiguous(), dy.contiguous().to(x.dtype)
    dx = torch.empty_like(x)
    n = dy.numel()
    _gated_bwd_kernel[grid1d(n)](x, dy, dx, n, h, ACT=_CODE[activation], OUT_BF16=is_bf16(x), BLOCK=BLOCK)
    return dx


def _act(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")


def gated_forward_torch(x: torch.Tensor, activation: str) -> torch.Tensor:
    _check(x)
    gate, up = x.chunk(2, dim=-1)
    return _act(gate, activation) * up


def gated_backward_torch(x: torch.Tensor, dy: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    dact = dy * up
    if activation == "silu":
        dgate = torch.ops.aten.silu_backward(dact, gate)
    else:
        approx = "tanh" if activation == "gelu_tanh" else "none"
        dgate = torch.ops.aten.gelu_backward(dact, gate, approximate=approx)
    return torch.cat([dgate, dy * _act(gate, activation)], dim=-1)


class GatedFunction(torch.autograd.Function):
    """``act(gate) * up`` saving only ``x = [gate, up]``."""

    @staticmethod
    def forward(ctx, x, activation: str):
        ctx.save_for_backward(x)
        ctx.activation = activation
        if use_triton(x):
            return gated_forward_triton(x, activation)
        return gated_forward_torch(x, activation)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        if use_triton(x):
            return gated_backward_triton(x, dy, ctx.activation), None
        return gated_backward_torch(x, dy, ctx.activation), None


class SwiGLU(nn.Module):
    """``silu(gate) * up`` over the two halves of the last dimension.

    Example:
        >>> SwiGLU()(torch.randn(4, 2 * 8)).shape
        torch.Size([4, 8])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GatedFunction.apply(x, "silu")


class GeGLU(nn.Module):
    """``gelu(gate) * up`` over the two halves of the last dimension.

    Args:
        approximate: ``"none"`` (erf) or ``"tanh"``, as for ``nn.GELU``.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GatedFunction.apply(x, "gelu_tanh" if self.approximate == "tanh" else "gelu")

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
