"""Counting what autograd keeps for backward (tests and benchmarks)."""

from __future__ import annotations

import torch
from torch import nn


def saved_activation_bytes(module: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for ``module(*inputs).sum().backward()``,
    parameters excluded.

    Counted with ``saved_tensors_hooks``, which see what ``autograd.Function``\\ s
    keep with ``ctx.save_for_backward`` (a tensor stored as a ``ctx`` attribute
    would hide from it; fastpipe's layers never do that).
    """
    params = {id(p) for p in module.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if id(t) not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs).sum().backward()
    return total
