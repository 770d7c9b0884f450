"""LayerNorm and RMSNorm over the last dimension that save the input and one fp32
statistic per row (``rstd``; fp64 for fp64 inputs); backward recomputes the rest.

    LayerNorm: y = (x - mean) · rstd · w + b      saved: x, rstd  (mean recomputed)
    RMSNorm:   y = x · rstd · w                   saved: x, rstd

Backward, with x̂ = normalized x and g = w · dy (means over the row):
    LayerNorm: dx = rstd · (g - mean(g) - x̂ · mean(g · x̂))
    RMSNorm:   dx = rstd · (g - x̂ · mean(g · x̂))
    dw = Σ_rows dy · x̂,  db = Σ_rows dy
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

from fastpipe.kernels._dispatch import use_triton
from fastpipe.kernels._triton import is_bf16, on_tensor_device, store

__all__ = [
    "LayerNorm", "NormFunction", "RMSNorm", "norm_backward_torch", "norm_backward_triton",
    "norm_forward_torch", "norm_forward_triton",
]


@triton.jit
def _norm_fwd_kernel(
    X,
    W,
    B,
    Y,
    RSTD,
    N,
    eps,
    RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        xc = tl.where(mask, x - tl.sum(x, axis=0) / N, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    store(Y + row * N + cols, y, mask, OUT_BF16)
    tl.store(RSTD + row, rstd)


@triton.jit
def _norm_bwd_kernel(
    X,
    W,
    DY,
    RSTD,
    DX,
    N,
    RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    if RMS:
        xhat = x * rstd
    else:
        xhat = tl.where(mask, (x - tl.sum(x, axis=0) / N) * rstd, 0.0)  # mean recomputed
    g = dy
    if HAS_W:
        g = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dx = g - xhat * (tl.sum(g * xhat, axis=0) / N)
    if not RMS:
        dx = dx - tl.sum(g, axis=0) / N
    store(DX + row * N + cols, dx * rstd, mask, OUT_BF16)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    n = x.shape[-1]
    return x.contiguous().view(-1, n), n


@on_tensor_device
def norm_forward_triton(x, weight, bias, eps: float, rms: bool):
    """Launcher: (y, rstd[rows] fp32), one program per row."""
    x2, n = _rows(x)
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    _norm_fwd_kernel[(x2.shape[0],)](
        x2, weight if weight is not None else x2, bias if bias is not None else x2, y, rstd, n, eps,
        RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None, OUT_BF16=is_bf16(x),
        BLOCK_N=triton.next_power_of_2(n),
    )
    return y.view(x.shape), rstd


@on_tensor_device
def norm_backward_triton(x, weight, dy, rstd, rms: bool) -> torch.Tensor:
    x2, n = _rows(x)
    dy2 = dy.contiguous().view(-1, n).to(x.dtype)
    dx = torch.empty_like(x2)
    _norm_bwd_kernel[(x2.shape[0],)](
        x2, weight if weight is not None else x2, dy2, rstd, dx, n,
        RMS=rms, HAS_W=weight is not None, OUT_BF16=is_bf16(x), BLOCK_N=triton.next_power_of_2(n),
    )
    return dx.view(x.shape)


# --- torch reference ----------------------------------------------------------


def _acc(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _xhat(x2: torch.Tensor, rstd: torch.Tensor, rms: bool) -> torch.Tensor:
    xf = _acc(x2)
    centered = xf if rms else xf - xf.mean(-1, keepdim=True)
    return centered * rstd[:, None]


def norm_forward_torch(x, weight, bias, eps: float, rms: bool):
    """(y, rstd): y from torch's own layer so the output matches plain layers."""
    n = x.shape[-1]
    xf = _acc(x).view(-1, n)
    centered = xf if rms else xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centered.pow(2).mean(-1) + eps)
    y = F.rms_norm(x, (n,), weight, eps) if rms else F.layer_norm(x, (n,), weight, bias, eps)
    return y, rstd


def norm_backward_torch(x, weight, dy, rstd, rms: bool) -> torch.Tensor:
    x2, n = _rows(x)
    xhat = _xhat(x2, rstd, rms)
    g = _acc(dy.reshape(-1, n))
    if weight is not None:
        g = g * _acc(weight)
    dx = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not rms:
        dx = dx - g.mean(-1, keepdim=True)
    return (dx * rstd[:, None]).to(x.dtype).view(x.shape)


class NormFunction(torch.autograd.Function):
    """LayerNorm / RMSNorm saving ``x`` and ``rstd`` only."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool):
        impl = norm_forward_triton if use_triton(x) else norm_forward_torch
        y, rstd = impl(x, weight, bias, eps, rms)
        ctx.save_for_backward(x, weight, rstd)
        ctx.rms, ctx.has_bias = rms, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        impl = norm_backward_triton if use_triton(x) else norm_backward_torch
        dx = impl(x, weight, dy, rstd, ctx.rms) if ctx.needs_input_grad[0] else None
        dw = db = None
        n = x.shape[-1]
        if weight is not None and ctx.needs_input_grad[1]:
            xhat = _xhat(x.contiguous().view(-1, n), rstd, ctx.rms)
            dw = (_acc(dy.reshape(-1, n)) * xhat).sum(0).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = _acc(dy.reshape(-1, n)).sum(0).to(dy.dtype)
        return dx, dw, db, None, None


def _last_dim(shape) -> int:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if len(dims) != 1:
        raise ValueError(f"only normalization over the last dimension is supported, got {dims}")
    return dims[0]


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` over the last dimension that saves ``x`` and one fp32 ``rstd`` per row.

    Example:
        >>> LayerNorm(8)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    rms = False

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self._adopt(nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias=bias,
                                 device=device, dtype=dtype))

    @classmethod
    def from_module(cls, norm: nn.Module):
        """Wraps an existing ``nn.LayerNorm`` / ``nn.RMSNorm``, sharing its parameters."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._adopt(norm)
        return layer

    def _adopt(self, norm: nn.Module) -> None:
        self.normalized_shape = (_last_dim(norm.normalized_shape),)
        self.eps = norm.eps
        self.register_parameter("weight", norm.weight)
        self.register_parameter("bias", getattr(norm, "bias", None))

    def _eps(self, x: torch.Tensor) -> float:
        return self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.normalized_shape[0]:
            raise ValueError(f"expected last dimension {self.normalized_shape[0]}, got {tuple(x.shape)}")
        return NormFunction.apply(x, self.weight, self.bias, self._eps(x), self.rms)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class RMSNorm(LayerNorm):
    """``nn.RMSNorm`` over the last dimension that saves ``x`` and one fp32 ``rstd`` per row."""

    rms = True

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None) -> None:
        nn.Module.__init__(self)
        self._adopt(nn.RMSNorm(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype))

    def _eps(self, x: torch.Tensor) -> float:
        # torch's default: the input dtype's machine epsilon
        return self.eps if self.eps is not None else torch.finfo(x.dtype).eps
