"""An activation followed by a Linear, without storing the activation's output.

Plain PyTorch keeps two tensors of the hidden size for ``Linear(act(h))``:
``h`` (for the activation's backward) and ``a = act(h)`` (for the Linear's
weight gradient). ``ActLinear`` keeps only ``h``; its backward recomputes
``a`` in the same kernel pass that computes ``dh``:

    forward:  h ──act──► a ──Linear──► y            saved: h (a is dropped)
    backward: da = dy @ W
              (dh, a) = act_bwd(h, da)              one pass over h and da
              dW = dyᵀ a,  db = Σ dy

Activations: ``"relu"``, ``"silu"``, ``"gelu"`` (erf) and ``"gelu_tanh"``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

from fastpipe.kernels._dispatch import use_triton
from fastpipe.kernels._triton import BLOCK, block, grid1d, is_bf16, on_tensor_device, store

__all__ = [
    "ACTIVATIONS", "ActLinear", "ActLinearFunction", "Deferred", "act_backward_torch",
    "act_backward_triton", "act_forward_torch", "act_forward_triton",
]

ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh")
_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}


# --- Triton ------------------------------------------------------------------


@triton.jit
def _act_and_grad(h, ACT: tl.constexpr):
    """(act(h), act'(h)) in fp32."""
    if ACT == 0:  # relu
        a = tl.maximum(h, 0.0)
        g = tl.where(h > 0.0, 1.0, 0.0)
    elif ACT == 1:  # silu
        s = tl.sigmoid(h)
        a = h * s
        g = s * (1.0 + h * (1.0 - s))
    elif ACT == 2:  # gelu, erf form
        cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
        a = h * cdf
        g = cdf + h * 0.3989422804014327 * tl.exp(-0.5 * h * h)
    else:  # gelu, tanh form; tanh(u) = 2 sigmoid(2u) - 1 (no libdevice needed)
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        a = 0.5 * h * (1.0 + t)
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
        g = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * du
    return a, g


@triton.jit
def _act_fwd_kernel(
    H,
    A,
    N,
    ACT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs, mask = block(N, BLOCK)
    h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(h, ACT)
    store(A + offs, a, mask, OUT_BF16)


@triton.jit
def _act_bwd_kernel(
    H,
    DA,
    DH,
    A,
    N,
    ACT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs, mask = block(N, BLOCK)
    h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    da = tl.load(DA + offs, mask=mask, other=0.0).to(tl.float32)
    a, g = _act_and_grad(h, ACT)
    store(DH + offs, da * g, mask, OUT_BF16)
    store(A + offs, a, mask, OUT_BF16)  # recomputed for the weight gradient


@on_tensor_device
def act_forward_triton(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Launcher: ``act(h)`` by the forward kernel."""
    h = h.contiguous()
    a = torch.empty_like(h)
    n = h.numel()
    _act_fwd_kernel[grid1d(n)](h, a, n, ACT=_CODE[activation], OUT_BF16=is_bf16(h), BLOCK=BLOCK)
    return a


@on_tensor_device
def act_backward_triton(h: torch.Tensor, da: torch.Tensor, activation: str):
    """Launcher: ``(dh, act(h))`` from one pass over ``h`` and ``da``."""
    h, da = h.contiguous(), da.contiguous().to(h.dtype)
    dh, a = torch.empty_like(h), torch.empty_like(h)
    n = h.numel()
    _act_bwd_kernel[grid1d(n)](
        h, da, dh, a, n, ACT=_CODE[activation], OUT_BF16=is_bf16(h), BLOCK=BLOCK
    )
    return dh, a


# --- torch reference (CPU path and oracle) ------------------------------------


def act_forward_torch(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return F.relu(h)
    if activation == "silu":
        return F.silu(h)
    return F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")


def act_backward_torch(h: torch.Tensor, da: torch.Tensor, activation: str):
    """(dh, act(h)) with torch's own backward formulas, so numerics match plain layers."""
    a = act_forward_torch(h, activation)
    if activation == "relu":
        dh = torch.ops.aten.threshold_backward(da, a, 0)
    elif activation == "silu":
        dh = torch.ops.aten.silu_backward(da, h)
    else:
        approx = "tanh" if activation == "gelu_tanh" else "none"
        dh = torch.ops.aten.gelu_backward(da, h, approximate=approx)
    return dh, a


def act_forward(h: torch.Tensor, activation: str) -> torch.Tensor:
    return act_forward_triton(h, activation) if use_triton(h) else act_forward_torch(h, activation)


def act_backward(h: torch.Tensor, da: torch.Tensor, activation: str):
    if use_triton(h):
        return act_backward_triton(h, da, activation)
    return act_backward_torch(h, da, activation)


# --- autograd -----------------------------------------------------------------


class ActLinearFunction(torch.autograd.Function):
    """``linear(act(h), weight, bias)`` saving ``h`` and the weight only."""

    @staticmethod
    def forward(ctx, h, weight, bias, activation: str):
        out = F.linear(act_forward(h, activation), weight, bias)
        ctx.save_for_backward(h, weight)
        ctx.activation, ctx.has_bias = activation, bias is not None
        return out

    @staticmethod
    def backward(ctx, dy):
        h, weight = ctx.saved_tensors
        da = dy.matmul(weight)  # [..., out] @ [out, in]
        if ctx.needs_input_grad[0]:
            dh, a = act_backward(h, da, ctx.activation)
        else:
            dh, a = None, act_forward(h, ctx.activation)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = dy2.t().matmul(a.reshape(-1, a.shape[-1])) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dh, dw, db, None


class ActLinear(nn.Module):
    """``linear(act(x))`` that stores ``x`` but not ``act(x)``; backward recomputes it.

    Args:
        activation: ``"relu"``, ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``.
        in_features, out_features, bias: as for ``nn.Linear``.

    Example:
        >>> layer = ActLinear("gelu", 64, 16)
        >>> layer(torch.randn(4, 64)).shape
        torch.Size([4, 16])
    """

    def __init__(self, activation: str, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self._adopt(activation, nn.Linear(in_features, out_features, bias, device=device, dtype=dtype))

    @classmethod
    def from_linear(cls, activation: str, linear: nn.Linear) -> ActLinear:
        """Wraps an existing Linear, sharing its parameter objects (optimizers keep working)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._adopt(activation, linear)
        return layer

    def _adopt(self, activation: str, linear: nn.Linear) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ActLinearFunction.apply(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return (f"{self.activation}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class Deferred(nn.Module):
    """Stands where an activation was, passing its input on: the ``ActLinear`` after
    it applies the activation. Keeps layer indices (and parameter names) unchanged."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original_name = type(original).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{self.original_name} applied by the next ActLinear"
