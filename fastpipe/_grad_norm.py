"""Gradient clipping over a whole pipeline.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on one rank of a
distributed pipeline sees that rank's gradients only: each rank would
compute its own norm and scale by its own factor, and the update would not
be the unsplit model's. Here each rank computes the norm of the gradients
it counts, the ranks combine them over the group (a sum of ``norm ** p``,
or a max for the infinity norm), and every rank scales by the one total, as
torch's function does for the unsplit model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fastpipe.runtime.transport.groups import all_reduce

__all__ = ["clip_grad_norm"]


def clip_grad_norm(counted: Sequence[torch.Tensor], scaled: Sequence[torch.Tensor], max_norm: float,
                   norm_type: float, error_if_nonfinite: bool, foreach: bool | None,
                   group: dist.ProcessGroup | None, device: torch.device | None) -> torch.Tensor:
    """Scales ``scaled``'s gradients so that the total norm of every rank's
    ``counted`` gradients is at most ``max_norm``; returns that total norm.

    Args:
        counted: Parameters whose gradients make up this rank's part of the
            norm (each parameter of the model on exactly one rank).
        scaled: Parameters whose gradients are scaled (every one this rank
            holds, tied copies included).
        group: The pipeline's group, or None in local mode (``counted`` is
            then the whole model and no collective runs).
        device: Where the reduced norm lives (the rank's device: NCCL needs a GPU).
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in counted if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    if device is not None:
        # In float64 on every rank: one with no gradients has no dtype to offer.
        dtype = total.dtype if grads else torch.get_default_dtype()
        total = total.to(device, torch.float64)
        if math.isinf(norm_type):
            all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        elif norm_type == 0:  # a count of nonzero entries: counts add
            all_reduce(total, group=group)
        else:
            part = total ** norm_type
            all_reduce(part, group=group)
            total = part ** (1.0 / norm_type)
        total = total.to(dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        # The same total on every rank: all raise, none has scaled anything.
        raise RuntimeError(
            f"the total norm of order {norm_type} of the pipeline's gradients is non-finite, so it "
            "cannot be clipped; set error_if_nonfinite=False to scale by it anyway")
    torch.nn.utils.clip_grads_with_norm_([p for p in scaled if p.grad is not None], max_norm,
                                         total, foreach)
    return total
