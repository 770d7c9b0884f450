"""The Zero Bubble family (Qi et al. 2023/2024): ZB-H1, ZB-H2 and ZB-V, by list scheduling.

All three split each backward into I (input gradient, on the critical path)
and W (weight gradient, free to move), and are built by the list scheduler in
``_greedy``; they differ in placement and in the in-flight cap. Given costs
(``build(..., costs=)``) the scheduler orders by them; the numbers below are
at F = I = W = 1 per stage and were measured for every
``p <= 8``, ``m <= 32`` (``tests/test_schedules_simulate.py`` checks them).
Both caps bound memory: "between F and I" is the full activations, the
``peak_inflight`` of a simulation; "between F and W" adds what W still needs.
``lean=True`` sets the second cap to the first: a microbatch waiting for its
W then counts as a whole one, so a rank holds no more microbatches, in any
state, than its F-to-I cap (1F1B's count for ZB-H1 and ZB-V; unless the cap
gives way rather than stall every rank, as ``_greedy`` says), even where
W's inputs and gradients weigh as much as the activations (a vocabulary
head's); the price is some of the bubble the extra W slots filled. With
``sizes`` (per stage, the bytes a microbatch holds from F to I and from I
to W) a lean order counts bytes instead: no rank holds more than its F-to-I
cap's activations, so stages whose W reads little keep more W work to fill
the bubble and a heavy one (the head) runs its W sooner.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastpipe.schedules._costs import Costs
from fastpipe.schedules._greedy import list_schedule
from fastpipe.schedules._ir import Schedule
from fastpipe.schedules._placement import loop_placement, v_placement

__all__ = ["zb_h1", "zb_h2", "zbv"]

Sizes = Sequence[tuple[float, float]]  # per stage: bytes from F to I, from I to W


def zb_h1(ranks: int, microbatches: int, stages_per_rank: int = 1, costs: Costs | None = None,
          latency: float = 0.0, lean: bool = False, sizes: Sizes | None = None) -> Schedule:
    """ZB-H1: 1F1B's in-flight count, W filling the drain; a third of 1F1B's bubble.

    Caps: ``p - r`` microbatches between F and I on rank ``r`` (1F1B's
    in-flight count), ``p + ceil(p / 2)`` between F and W (the smallest that
    keeps the makespan at ``3 m + p - 1`` for every ``p <= 8``; W reads the
    layers' inputs and output gradients, on transformer blocks more bytes than
    the forward saved: ``docs/benchmarks.md``, "Zero-bubble memory").

    For every ``m >= p`` the makespan is ``3 m + p - 1``: total idle
    ``p (p - 1)``, exactly one third of 1F1B's ``3 p (p - 1)`` at F = 1,
    B = 2, as the paper's ``(p - 1)(T_F + T_B - T_W)`` predicts. No schedule
    can do better here (the last rank cannot start before step ``p - 1``).
    Rank ``r`` waits ``r`` steps for its first input and ``p - 1 - r`` steps
    inside its list (``interior_idle``). Peak in-flight (F to I): ``min(p - r, m)``.

    Args:
        ranks: Pipeline ranks ``p``; one stage each.
        microbatches: Microbatches ``m``.
        stages_per_rank: Must be 1 (checked by ``build``).
        costs, latency: what the list scheduler orders by (``build``); the
            figures above are for unit costs.
        lean: the F-to-W cap equal to the F-to-I cap (module docstring).
        sizes: with ``lean``, that cap in bytes (module docstring).

    Returns:
        The schedule.
    """
    caps = [ranks - r for r in range(ranks)]
    holds = caps if lean else [ranks + (ranks + 1) // 2] * ranks
    return list_schedule("zb-h1", microbatches, loop_placement(ranks, 1), caps, holds, costs, latency,
                         sizes if lean else None)


def zb_h2(ranks: int, microbatches: int, stages_per_rank: int = 1, costs: Costs | None = None,
          latency: float = 0.0, lean: bool = False, sizes: Sizes | None = None) -> Schedule:
    """ZB-H2: more warm-up forwards so that no rank ever waits once it has started.

    Caps: ``2 (p - r) - 1`` between F and I on rank ``r`` (rank 0 holds
    ``2 p - 1``, enough to cover the round trip to the last rank and back),
    ``2 p - 1`` between F and W.

    For ``m >= 2 p - 1`` every rank works without a gap from its first action
    to its last (``interior_idle`` is 0): the paper's zero bubble. Like the
    paper's schedule it is a parallelogram, rank ``r`` busy from ``r`` to
    ``3 m + r``, so with one clock for all ranks the makespan is
    ``3 m + p - 1`` (for every ``m >= p``) and ``bubble_ratio`` is
    ``(p - 1) / (3 m + p - 1)``, all of it the unavoidable fill and its
    mirror at the end; the paper removes that by not synchronising before the
    optimizer step. With one clock, then, ZB-H2's makespan equals ZB-H1's.

    Args:
        ranks: Pipeline ranks ``p``; one stage each.
        microbatches: Microbatches ``m``.
        stages_per_rank: Must be 1 (checked by ``build``).
        costs, latency: what the list scheduler orders by (``build``); the
            figures above are for unit costs.
        lean: the F-to-W cap equal to the F-to-I cap (module docstring).
        sizes: with ``lean``, that cap in bytes (module docstring).

    Returns:
        The schedule.
    """
    caps = [2 * (ranks - r) - 1 for r in range(ranks)]
    holds = caps if lean else [2 * ranks - 1] * ranks
    return list_schedule("zb-h2", microbatches, loop_placement(ranks, 1), caps, holds, costs, latency,
                         sizes if lean else None)


def zbv(ranks: int, microbatches: int, stages_per_rank: int = 2, costs: Costs | None = None,
        latency: float = 0.0, lean: bool = False, sizes: Sizes | None = None) -> Schedule:
    """ZB-V: V placement and I/W split, 1F1B's in-flight count, zero bubble.

    Rank ``r`` holds stages ``r`` and ``2 p - 1 - r``, each half of a 1F1B
    stage. Caps: ``2 p`` stage-microbatches between F and I on every rank
    (``p`` full microbatches, 1F1B's rank-0 count), ``2 p + 3 + r`` between F
    and W (found by a sweep over ``p <= 8``, ``m <= 32``): what W reads of
    three or four microbatches waits beyond 1F1B's count (``lean``: none).

    For ``m >= 2 p - 1`` no rank has a gap between its first and last action
    (``interior_idle`` is 0): zero bubble in the paper's sense. It is a
    parallelogram like ZB-H2, rank ``r`` busy from ``r`` to ``6 m + r``: for
    ``m >= p + 2`` (and every ``m >= p`` when ``p <= 4``) the makespan is
    ``6 m + p - 1``, the least possible, and ``bubble_ratio`` is
    ``(p - 1) / (6 m + p - 1)``.

    Args:
        ranks: Pipeline ranks ``p``.
        microbatches: Microbatches ``m``.
        stages_per_rank: Must be 2 (checked by ``build``).
        costs, latency: what the list scheduler orders by (``build``); the
            figures above are for unit costs.
        lean: the F-to-W cap equal to the F-to-I cap (module docstring).
        sizes: with ``lean``, that cap in bytes (module docstring).

    Returns:
        The schedule.
    """
    caps = [2 * ranks] * ranks
    holds = caps if lean else [2 * ranks + 3 + r for r in range(ranks)]
    return list_schedule("zbv", microbatches, v_placement(ranks), caps, holds, costs, latency,
                         sizes if lean else None)
