"""What ``Pipe.step`` and ``Pipe.forward`` hand back into the caller's
autograd: the first stage's input gradients, carried on into the graph that
made the input; inference outputs that refuse a backward with a hint."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["backward_into_inputs", "no_backward"]


class _InferenceOnly(torch.autograd.Function):
    """Marks ``pipe(x)``'s output as one autograd cannot go back through:
    in grad mode it requires grad, as a module's output would, and a
    backward through it says what to call instead of torch's "does not
    require grad"."""

    @staticmethod
    def forward(ctx, x, parameter):  # the parameter makes autograd track the output
        return x.detach()  # not a view: in-place ops on the output stay allowed

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "the output of pipe(x) has no graph: Pipe.forward runs the microbatches without "
            "autograd; train with loss = pipe.step(x, target, loss_fn), which runs the "
            "backward of every microbatch")


def no_backward(value: Any, parameter: torch.Tensor) -> Any:
    if isinstance(value, tuple):
        return tuple(no_backward(v, parameter) for v in value)
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return _InferenceOnly.apply(value, parameter)
    return value


def backward_into_inputs(x: Any, grads: dict[int, list[torch.Tensor | None]], chunks: int) -> None:
    """Carries the first stage's input gradients into the caller's tensors:
    one backward for the whole batch (into ``x.grad`` for a leaf, on
    through the graph that made ``x`` otherwise), as ``loss.backward()``
    on the unsplit model does. An input no microbatch's gradient reached
    (None in every one) gets none; where only some were reached, the rest
    are zeros, as autograd's sum over the batch would make them."""
    wanting = [t for t in (x if isinstance(x, tuple) else (x,)) if t.requires_grad]
    roots, whole = [], []
    for i, t in enumerate(wanting):
        parts = [grads[mb][i] for mb in range(chunks)]
        if all(g is None for g in parts):
            continue
        rows = torch.tensor_split(t, chunks)
        roots.append(t)
        whole.append(torch.cat([torch.zeros_like(r) if g is None else g.to(t.device)
                                for g, r in zip(parts, rows)]))
    if roots:
        torch.autograd.backward(roots, whole)
