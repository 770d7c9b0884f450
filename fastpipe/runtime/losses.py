"""The losses fastpipe knows: value and gradient in one go, without a graph.

When the last stage runs as a chain (``fastpipe.runtime.chain``) and
``loss_fn`` is one of

- ``nn.functional.mse_loss`` or an ``nn.MSELoss`` (reduction "mean" or "sum"),
- ``nn.functional.cross_entropy`` or an ``nn.CrossEntropyLoss`` (class-index
  targets, no class weights, no label smoothing, reduction "mean" or "sum"),

the executor computes the loss and the gradient of its output with the ops
autograd's formulas run (``mse_loss_backward``; ``nll_loss_backward`` and
``_log_softmax_backward_data``), bit for bit what autograd computes
(tests/test_losses.py). Anything else, a patched function or ``forward``,
a hook on the loss module, an output or target of another shape, dtype,
device or tensor type, a target that wants a gradient, goes through
autograd as before.

Why: after a chain stage the loss's graph and engine call are a large share
of the last rank's time on narrow models (``docs/design/iw-split.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastpipe.runtime.eager_checks import global_hooks, module_hooked, originals, patched

__all__ = ["KnownLoss", "known_loss"]

_aten = torch.ops.aten
_REDUCTIONS = {"mean": 1, "sum": 2}  # at::Reduction
# What a known loss calls, as it was at import (a patch is the user's to run).
_ORIGINALS = originals([(F, "mse_loss"), (F, "cross_entropy"), (nn.MSELoss, "forward"),
                        (nn.CrossEntropyLoss, "forward"), (nn.Module, "__call__"),
                        (nn.Module, "_call_impl")])
_MSE_FN, _CE_FN = F.mse_loss, F.cross_entropy


class KnownLoss:
    """One step's known loss: ``value_and_grad`` per microbatch."""

    def __init__(self, kind: str, reduction: str, ignore_index: int = -100) -> None:
        self.kind, self.ignore_index = kind, ignore_index
        self.reduction = _REDUCTIONS[reduction]

    def value_and_grad(self, out: torch.Tensor, target: Any, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(loss, d(scale * loss)/d out)``, or None where this microbatch
        must go through autograd (the check is what autograd would do
        differently: broadcasting, type promotion, another tensor type)."""
        if type(target) is not torch.Tensor or type(out) is not torch.Tensor \
                or target.requires_grad or target.device != out.device:
            return None
        with torch.no_grad():
            if self.kind == "mse":
                if target.shape != out.shape or target.dtype != out.dtype:
                    return None
                loss = _aten.mse_loss(out, target, self.reduction)
                seed = torch.full_like(loss, scale)
                return loss, _aten.mse_loss_backward(seed, out, target, self.reduction)
            if out.dim() != 2 or target.dim() != 1 or target.dtype != torch.int64 \
                    or target.shape[0] != out.shape[0] or not out.is_floating_point():
                return None
            logp = _aten._log_softmax(out, 1, False)
            loss, total = _aten.nll_loss_forward(logp, target, None, self.reduction,
                                                 self.ignore_index)
            seed = torch.full_like(loss, scale)
            g = _aten.nll_loss_backward(seed, logp, target, None, self.reduction,
                                        self.ignore_index, total)
            return loss, _aten._log_softmax_backward_data(g, logp, 1, out.dtype)


def known_loss(loss_fn: Callable | None) -> KnownLoss | None:
    """The KnownLoss ``loss_fn`` is, or None. Checked once a step, with the
    chain's own checks (no torch function or dispatch mode, no anomaly
    mode), which the executor requires of the last stage first."""
    if loss_fn is None or patched(_ORIGINALS):
        return None
    if loss_fn is _MSE_FN:
        return KnownLoss("mse", "mean")
    if loss_fn is _CE_FN:
        return KnownLoss("ce", "mean")
    t = type(loss_fn)
    if t is not nn.MSELoss and t is not nn.CrossEntropyLoss:
        return None
    if module_hooked(loss_fn) or global_hooks() or "forward" in loss_fn.__dict__ \
            or loss_fn.reduction not in _REDUCTIONS:
        return None
    if t is nn.MSELoss:
        return KnownLoss("mse", loss_fn.reduction)
    if loss_fn.weight is not None or loss_fn.label_smoothing != 0.0:
        return None
    return KnownLoss("ce", loss_fn.reduction, loss_fn.ignore_index)
