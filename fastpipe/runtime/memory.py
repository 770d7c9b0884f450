"""Counting the bytes autograd saves for backward, parameters excluded.

A saved parameter is often a view of it (``weight.t()`` for a Linear), so
parameters are recognised by storage, not by identity. A tensor saved twice
(by two nodes, or by autograd and a deferred layer's W) counts once: tensors
are told apart by address and size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["SavedBytes", "saved_activation_bytes", "span"]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) that tells a live tensor apart from the others: its
    data's address, or, where it has none to read (meta tensors, wrapper
    subclasses, sparse layouts), its object's."""
    try:
        ptr = t.data_ptr()
    except RuntimeError:
        ptr = 0
    return ptr or id(t), t.numel() * t.element_size()


class SavedBytes:
    """A running count of saved-tensor bytes (``total``) while ``counting()`` is active.

    The hooks chain to any saved-tensor hooks already active on the thread
    (offloading, for instance), so counting changes nothing else. ``params``
    is iterated at the first count (a generator over modules then sees the
    parameters they hold at that moment). Each ``counting()`` starts a new
    set of the tensors seen (``seen``, their (address, bytes)); ``add``
    counts more tensors into it after the fact.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        # Walked at the first count, not here: most steps count nothing (the
        # sizes are known from an earlier step), and an executor, made every
        # step before the rank's first action, would walk them each time.
        self._given = params
        self._params: set[int] | None = None
        self.seen: set[tuple[int, int]] = set()
        self.total = 0

    def _pack(self, t: torch.Tensor):
        if self._params is None:
            self._params = {_storage(p) for p in self._given}
        if _storage(t) not in self._params:
            self.add((span(t),))
        return self._outer[0](t) if self._outer else t

    def _unpack(self, packed):
        return self._outer[1](packed) if self._outer else packed

    def add(self, spans: Iterable[tuple[int, int]]) -> None:
        """Counts the (address, bytes) ``spans`` not yet seen since ``counting()``."""
        for span in spans:
            if span not in self.seen:
                self.seen.add(span)
                self.total += span[1]

    @contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        self.seen = set()
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def saved_activation_bytes(module: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for ``module(*inputs).sum().backward()``.

    Counted with ``saved_tensors_hooks``, which see what ``autograd.Function``\\ s
    keep with ``ctx.save_for_backward`` (a tensor stored as a ``ctx`` attribute
    would hide from it; fastpipe's layers never do that).
    """
    counter = SavedBytes(module.parameters())
    with counter.counting():
        out = module(*inputs)
    out.sum().backward()
    return counter.total
