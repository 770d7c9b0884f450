"""Dropout that keeps a seed, not a mask: backward regenerates the mask (Philox).

``nn.Dropout`` saves a mask of the input's size for backward. ``SeededDropout``
draws one 62-bit seed from torch's generator per call (so ``torch.manual_seed``
and checkpoint replay still decide the masks) and saves nothing else: element
``i`` is kept when ``uniform(philox(seed, i)) >= p``, in forward and again in
backward. The Triton kernels use ``tl.rand``; the torch reference computes
the same Philox-4x32-10 stream, so both give the same mask bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from fastpipe.kernels._dispatch import use_triton
from fastpipe.kernels._triton import BLOCK, block, grid1d, is_bf16, on_tensor_device, store

__all__ = [
    "SeededDropout", "SeededDropoutFunction", "draw_seed", "dropout_torch", "dropout_triton",
    "keep_mask", "philox_uniform",
]

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_SCALE = 4.6566127342e-10  # tl.rand's int32 -> [0, 1) factor


@triton.jit
def _dropout_kernel(
    X,
    Y,
    N,
    seed,
    p,
    scale,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Y = X * keep * scale with keep regenerated from (seed, element index);
    the same kernel serves forward (X = input) and backward (X = grad)."""
    offs, mask = block(N, BLOCK)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    keep = tl.rand(seed, offs) >= p
    store(Y + offs, tl.where(keep, x * scale, 0.0), mask, OUT_BF16)


@on_tensor_device
def dropout_triton(x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    _dropout_kernel[grid1d(n)](x, y, n, seed, p, 1.0 / (1.0 - p), OUT_BF16=is_bf16(x), BLOCK=BLOCK)
    return y


# --- torch reference ----------------------------------------------------------


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of ``a * b`` for a < 2**32 and int64 ``b`` in [0, 2**32),
    in 16-bit halves so nothing overflows int64."""
    p_lo = a * (b & 0xFFFF)  # < 2**48
    p_hi = a * (b >> 16)  # < 2**48
    s = ((p_hi & 0xFFFF) << 16) + p_lo  # < 2**49
    return (p_hi >> 16) + (s >> 32), s & _M32


def philox_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offsets)`` computed with int64 torch ops (any device)."""
    offsets = offsets.to(torch.int64)
    c0, c1 = offsets & _M32, (offsets >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mul32(_ROUND_B, c2)
        hi_a, lo_a = _mul32(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    signed = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # bitcast to int32
    signed = torch.where(signed < 0, -signed - 1, signed)
    return signed.to(torch.float32) * torch.tensor(_SCALE, dtype=torch.float32)


def keep_mask(shape: torch.Size, seed: int, p: float, device) -> torch.Tensor:
    offsets = torch.arange(int(torch.Size(shape).numel()), device=device)
    return (philox_uniform(seed, offsets) >= torch.tensor(p, dtype=torch.float32)).view(shape)


def dropout_torch(x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    keep = keep_mask(x.shape, seed, p, x.device)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def _apply(x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    return dropout_triton(x, seed, p) if use_triton(x) else dropout_torch(x, seed, p)


class SeededDropoutFunction(torch.autograd.Function):
    """Dropout whose backward regenerates the mask from the saved seed."""

    @staticmethod
    def forward(ctx, x, p: float, seed: int):
        ctx.p, ctx.seed = p, seed  # two numbers: no tensor is kept
        return _apply(x, seed, p)

    @staticmethod
    def backward(ctx, dy):
        return _apply(dy, ctx.seed, ctx.p), None, None


def draw_seed() -> int:
    """A 62-bit seed from torch's CPU generator (so manual_seed decides it)."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())


class SeededDropout(nn.Module):
    """``nn.Dropout`` (zeroes with probability ``p``, scales by ``1/(1-p)``) that saves a
    seed instead of a mask.

    Args:
        p: probability of an element to be zeroed, in [0, 1).

    Example:
        >>> drop = SeededDropout(0.1)
        >>> drop(torch.ones(2, 3)).shape
        torch.Size([2, 3])
    """

    draws_random = True  # fastpipe.runtime.checkpoint.stochastic: it draws a seed per call

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return SeededDropoutFunction.apply(x, self.p, draw_seed())

    def extra_repr(self) -> str:
        return f"p={self.p}"
