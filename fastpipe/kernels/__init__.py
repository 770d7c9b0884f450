"""Memory-saving layers: save small inputs, recompute cheap elementwise work in backward.

Each layer is a Triton kernel pair (forward, backward) for CUDA tensors, a
pure-torch reference with the same memory behaviour (the CPU path and the
test oracle), an ``autograd.Function`` and an ``nn.Module``.
``selective_recompute`` swaps them into an existing ``nn.Sequential``.
``fastpipe.kernels.pack`` holds the send-buffer packing kernels.

Names load on first access: importing this package does not import triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ActLinear": "activation", "Deferred": "activation", "GeGLU": "gated", "SwiGLU": "gated",
    "LayerNorm": "norm", "RMSNorm": "norm", "SeededDropout": "dropout", "backend": "_dispatch",
    "selective_recompute": "recompute",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"fastpipe.kernels.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'fastpipe.kernels' has no attribute {name!r}")
