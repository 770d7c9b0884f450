"""Cost models for the simulator: how long each compute action and each transfer takes."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from fastpipe.schedules._ir import Action

__all__ = ["Costs", "compute_cost", "rank_speeds", "transfer_cost"]

# A cost per kind: one number for every stage, or one number per stage.
CostValue = float | Sequence[float]
Costs = Mapping[str, CostValue] | Callable[[Action], float]

DEFAULT_COSTS: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
_KINDS = ("F", "B", "I", "W")


def compute_cost(costs: Costs | None, stages: int) -> Callable[[Action], float]:
    """Turn the user's ``costs`` into a function from a compute action to its cost.

    Args:
        costs: ``None`` for the defaults (F=1, B=2, I=1, W=1); a mapping from
            kind (``"F"``, ``"B"``, ``"I"``, ``"W"`` or a ``Kind``) to a number,
            or to a sequence of ``stages`` numbers for per-stage costs; or a
            callable ``(action) -> float`` for anything else. In a mapping,
            missing kinds take the defaults, except that a missing B costs
            I + W when I or W is given.
        stages: Number of stages, to check per-stage sequences.

    Returns:
        ``cost(action)`` for F, B, I and W actions.

    Raises:
        ValueError: For an unknown kind, a negative or non-finite cost, or a
            per-stage sequence whose length is not ``stages``.
    """
    if callable(costs):
        return costs
    # str(Kind.F) is "F", so Kind keys and string keys mean the same.
    given = {str(k): v for k, v in (costs or {}).items()}
    unknown = sorted(set(given) - set(_KINDS))
    if unknown:
        raise ValueError(f"unknown cost kinds {unknown}: costs take the kinds {list(_KINDS)}")
    table = {k: _per_stage(k, given.get(k, DEFAULT_COSTS[k]), stages) for k in "FIW"}
    if "B" in given:
        table["B"] = _per_stage("B", given["B"], stages)
    elif "I" in given or "W" in given:
        table["B"] = [i + w for i, w in zip(table["I"], table["W"])]
    else:
        table["B"] = [DEFAULT_COSTS["B"]] * stages
    return lambda action: table[action.kind.value][action.stage]


def _per_stage(kind: str, value: CostValue, stages: int) -> list[float]:
    values = [value] * stages if isinstance(value, (int, float)) else list(value)
    if len(values) != stages:
        raise ValueError(
            f"per-stage cost for {kind} has the wrong length (len: {len(values)}, stages: {stages})"
        )
    for v in values:
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"cost for {kind} must be a finite number >= 0, got {v!r}")
    return [float(v) for v in values]


def rank_speeds(rank_speed: Sequence[float] | None, ranks: int) -> list[float]:
    """Check per-rank speed factors (durations are divided by them).

    Raises:
        ValueError: If the length is not ``ranks`` or a factor is not > 0.
    """
    if rank_speed is None:
        return [1.0] * ranks
    speeds = list(rank_speed)
    if len(speeds) != ranks or any(not (isinstance(x, (int, float)) and x > 0) for x in speeds):
        raise ValueError(
            f"rank_speed must hold {ranks} positive numbers (one per rank), got {speeds!r}"
        )
    return [float(x) for x in speeds]


def transfer_cost(
    latency: float, bandwidth: float | None, message_bytes: float | Callable[[Action], float]
) -> Callable[[Action], float]:
    """The time one send takes to arrive: ``latency + bytes / bandwidth``.

    Args:
        latency: Fixed cost per transfer, >= 0.
        bandwidth: Bytes per cost unit, > 0; ``None`` ignores ``message_bytes``.
        message_bytes: Bytes per transfer, or ``(send_action) -> bytes``.

    Returns:
        ``cost(send_action)``.

    Raises:
        ValueError: If latency is negative or bandwidth is not positive.
    """
    if not latency >= 0:
        raise ValueError(f"latency must be >= 0, got {latency!r}")
    if bandwidth is None:
        return lambda action: float(latency)
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 (bytes per cost unit), got {bandwidth!r}")
    size = message_bytes if callable(message_bytes) else (lambda action: message_bytes)
    return lambda action: float(latency) + size(action) / bandwidth
