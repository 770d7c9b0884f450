"""Triton helpers shared by the kernels: rounding stores and the grid."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "block", "grid1d", "is_bf16", "on_tensor_device", "store", "to_bf16_rne"]

BLOCK = 1024  # elements per program of the elementwise kernels


def on_tensor_device(launcher):
    """Runs a launcher with its first argument's GPU as the current device.

    Triton launches on the current device and its current stream: a rank's
    thread whose current device is another GPU (or the default, 0) would
    run the kernel there, on pointers into this tensor's memory."""

    @functools.wraps(launcher)
    def launch(x, *args, **kwargs):
        if not x.is_cuda:
            return launcher(x, *args, **kwargs)
        with torch.cuda.device(x.device):
            return launcher(x, *args, **kwargs)

    return launch


def grid1d(n: int, block: int = BLOCK) -> tuple[int]:
    return (triton.cdiv(max(n, 1), block),)


@triton.jit
def block(N, BLOCK: tl.constexpr):
    """(offsets, mask) of this program's block of a flat range of N elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < N


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16 with round-to-nearest-even, written out so it does not depend
    on the backend's conversion (the interpreter's truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store(ptr, x, mask, OUT_BF16: tl.constexpr):
    """Stores fp32 ``x`` in the dtype of ``ptr``, rounding bf16 explicitly."""
    if OUT_BF16:
        tl.store(ptr, to_bf16_rne(x), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


def is_bf16(t) -> bool:
    import torch

    return t.dtype == torch.bfloat16
