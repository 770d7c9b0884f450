"""The backward of one stage: one engine call from its outputs (B, and I).

Zero-bubble schedules split a stage's backward into I (input gradients)
and W (weight gradients); the layers themselves make that split
(``fastpipe.runtime.deferred``), so every backward here is one plain
engine call.

``keep_graph=True`` leaves the saved tensors to be freed with the graph
when the caller drops its roots, not by the engine as it runs: what ranks on
threads of one interpreter want, since freeing a tensor Python has seen
takes the GIL (``docs/design/memory.md``, "Where saved tensors are freed").
The cost is memory: a microbatch's saved tensors stay until its backward
returns. Distributed ranks keep the default and free as they go.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["Root", "backward_full", "filled", "run_backward"]

Root = torch.Tensor | GradientEdge  # a stage output, or the graph edge it came from


def backward_full(roots: Sequence[Root], grads: Sequence[torch.Tensor | None],
                  keep_graph: bool = False) -> None:
    """B: one autograd pass; parameter and (leaf) input ``.grad`` accumulate.

    ``keep_graph=True`` leaves the saved tensors to be freed with the graph,
    when the caller drops its roots (see the module docstring: why threads
    that share one interpreter want that).
    """
    if not roots:
        return
    # The engine directly: ``autograd.backward``'s argument
    # handling is a dozen small ops, and each op hands the GIL over when
    # another rank's thread wants it (next to a forward on another thread,
    # that wrapper made the forward 2.5x slower).
    run_backward(tuple(roots), filled(roots, grads), keep_graph, False, (),
                 allow_unreachable=True, accumulate_grad=True)


def filled(roots: Sequence[Root], grads: Sequence[torch.Tensor | None]) -> tuple:
    """The gradients to start from: None (a loss's) is 1, as in ``Tensor.backward()``."""
    return tuple(torch.ones_like(r) if g is None else g for r, g in zip(roots, grads))


def _public_run_backward(edges, grads, keep_graph, create_graph, inputs, allow_unreachable,
                         accumulate_grad):
    if not accumulate_grad:
        return torch.autograd.grad(list(edges), list(inputs), list(grads), retain_graph=keep_graph,
                                   allow_unused=allow_unreachable)
    torch.autograd.backward(list(edges), list(grads), retain_graph=keep_graph,
                            inputs=list(inputs) or None)
    return ()


# torch.autograd.backward's own engine entry (keeps its TLS context and
# logging hooks); the public call where a torch version lacks it.
run_backward = getattr(torch.autograd.graph, "_engine_run_backward", _public_run_backward)
