"""Choosing ``balance``: how many layers each pipeline stage gets."""

from __future__ import annotations

from torch import nn

from fastpipe.balance._partition import partition

__all__ = ["balance_by_params", "partition"]


def balance_by_params(stages: int, model: nn.Sequential) -> list[int]:
    """Balance that evens out parameter counts across ``stages`` stages.

    Each layer costs its parameter count plus one, so layers without
    parameters still spread out instead of piling onto one stage.

    Example:
        >>> balance_by_params(2, nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
        [1, 2]
    """
    costs = [1 + sum(p.numel() for p in layer.parameters()) for layer in model]
    return partition(costs, stages)
