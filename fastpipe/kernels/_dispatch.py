"""Which implementation a layer runs: the Triton kernels or the torch reference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["backend", "use_triton"]

_CHOICES = ("auto", "triton", "torch")
_choice = "auto"


def use_triton(x: torch.Tensor) -> bool:
    """Triton for CUDA tensors (``auto``), or whatever ``backend`` forces.

    fp64 always takes the reference: the kernels compute in fp32.
    """
    if x.dtype == torch.float64:
        return False
    if _choice == "auto":
        return x.is_cuda
    return _choice == "triton"


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Forces the kernels' implementation inside the block (tests, benchmarks).

    ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` set before triton
    is imported; ``"torch"`` runs the reference everywhere; ``"auto"`` (the
    default) picks Triton for CUDA tensors.

    Raises:
        ValueError: an unknown name.
    """
    global _choice
    if name not in _CHOICES:
        raise ValueError(f"backend must be one of {list(_CHOICES)}, got {name!r}")
    previous, _choice = _choice, name
    try:
        yield
    finally:
        _choice = previous
