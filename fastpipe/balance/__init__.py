"""Choosing ``balance``: how many layers each pipeline stage gets.

Three ways, each a contiguous partition that minimises the largest stage
(dynamic programming) or, given which rank runs each stage, the busiest
rank (``partition``'s ``owners``; ``balance_by_time`` given a schedule
simulates it):

* ``balance_by_params``: parameter counts (no data needed);
* ``balance_by_time``: measured forward + backward time per layer, with
  optional per-stage speed factors for heterogeneous devices;
* ``balance_by_size``: measured memory per layer (parameters, gradients and
  optimizer state, plus saved activations for every microbatch).

``profile`` is the measurement behind the last two; ``fastpipe.plan`` uses it
to choose schedule, chunks and balance together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fastpipe.balance._partition import partition
from fastpipe.balance._profile import LayerProfile, Profile, profile

__all__ = [
    "LayerProfile", "Profile", "balance_by_params", "balance_by_size", "balance_by_time",
    "partition", "profile",
]


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


def balance_by_time(
    stages: int,
    model: nn.Sequential,
    sample,
    chunks: int = 1,
    device: str | torch.device = "cpu",
    speeds: Sequence[float] | None = None,
    schedule=None,
) -> list[int]:
    """Balance that evens out measured forward + backward time per stage.

    Args:
        stages: stages to split into (ranks × stages_per_rank).
        model, sample, chunks, device: see ``profile``.
        speeds: per-stage speed factors (a stage on a 2× faster device: 2.0).
        schedule: the ``Schedule`` the stages will run (``stages`` of them).
            Where a rank runs several stages, even stages can leave the
            ranks uneven (a V puts embedding and head on one rank): then the
            split whose simulated step is shortest is taken
            (``fastpipe._plan.balance_for``; ``speeds`` are not used).

    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        >>> sum(balance_by_time(2, model, torch.randn(8, 64)))
        3
    """
    return balance_from_profile(profile(model, sample, device, chunks), stages, speeds, schedule)


def balance_from_profile(prof: Profile, stages: int, speeds: Sequence[float] | None = None,
                         schedule=None) -> list[int]:
    """``balance_by_time``'s split of an existing profile (same arguments)."""
    if schedule is not None:
        if schedule.stages != stages:
            raise ValueError(f"schedule {schedule.name!r} has {schedule.stages} stages, not {stages}")
        if len(set(schedule.stage_to_rank)) < stages:
            from fastpipe._plan import balance_for

            return balance_for(prof, schedule)
    return partition([layer.forward + layer.backward for layer in prof.layers], stages, speeds)


def balance_by_size(
    stages: int,
    model: nn.Sequential,
    sample,
    chunks: int = 1,
    param_scale: float = 4.0,
    device: str | torch.device = "cpu",
    owners: Sequence[int] | None = None,
) -> list[int]:
    """Balance that evens out memory per stage (per rank, given ``owners``:
    see ``balance_by_time``).

    A layer needs ``param_scale ×`` its parameter bytes (4.0: the parameter,
    its gradient and Adam's two states) plus its saved activations for each
    of ``chunks`` microbatches (the most any schedule keeps alive at once).

    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        >>> len(balance_by_size(2, model, torch.randn(8, 64), chunks=2))
        2
    """
    if param_scale < 0:
        raise ValueError(f"param_scale must be >= 0, got {param_scale}")
    prof = profile(model, sample, device, chunks, repeats=1, warmup=0)
    costs = [layer.param_bytes * param_scale + layer.activation_bytes * chunks for layer in prof.layers]
    return partition(costs, stages, owners=owners)
