"""Memory-saving layers: save small inputs, recompute cheap elementwise work in backward.

Each layer is a Triton kernel pair (forward, backward) for CUDA tensors, a
pure-torch reference with the same memory behaviour (the CPU path and the
test oracle), an ``autograd.Function`` and an ``nn.Module``.
``selective_recompute`` swaps them into an existing ``nn.Sequential``.

Importing this package loads torch and triton; ``import fastpipe`` does not.
"""

from __future__ import annotations

from fastpipe.kernels._dispatch import backend
from fastpipe.kernels.activation import ActLinear, Deferred
from fastpipe.kernels.dropout import SeededDropout
from fastpipe.kernels.gated import GeGLU, SwiGLU
from fastpipe.kernels.norm import LayerNorm, RMSNorm
from fastpipe.kernels.recompute import selective_recompute

__all__ = [
    "ActLinear", "Deferred", "GeGLU", "LayerNorm", "RMSNorm", "SeededDropout", "SwiGLU",
    "backend", "selective_recompute",
]
