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


def backward_into_inputs(x: Any, grads: dict[int, list[torch.Tensor]], chunks: int) -> None:
    """Carries the first stage's input gradients into the caller's tensors:
    one backward for the whole batch (into ``x.grad`` for a leaf, on
    through the graph that made ``x`` otherwise), as ``loss.backward()``
    on the unsplit model does."""
    wanting = [t for t in (x if isinstance(x, tuple) else (x,)) if t.requires_grad]
    whole = [torch.cat([grads[mb][i] for mb in range(chunks)]).to(t.device)
             for i, t in enumerate(wanting)]
    torch.autograd.backward(wanting, whole)
