"""The classic generators: GPipe, 1F1B and looped breadth-first (one rule each)."""

from __future__ import annotations

from fastpipe.schedules._ir import Action, Kind, Schedule
from fastpipe.schedules._placement import loop_placement

__all__ = ["gpipe", "looped_bfs", "one_f_one_b"]


def gpipe(ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward.

    With F = 1 and B = 2 the bubble ratio is exactly ``(p - 1) / (m + p - 1)``:
    each rank idles ``(p - 1)`` forward slots while the pipeline fills and
    ``(p - 1)`` backward slots while it drains, out of ``3 (m + p - 1)``.
    Peak in-flight is ``m`` on every rank.

    Args:
        ranks: Pipeline ranks ``p``; one stage each.
        microbatches: Microbatches ``m``.
        stages_per_rank: Must be 1 (checked by ``build``).

    Returns:
        The schedule.
    """
    actions = [
        [Action(r, Kind.F, j) for j in range(microbatches)]
        + [Action(r, Kind.B, j) for j in range(microbatches)]
        for r in range(ranks)
    ]
    return Schedule("gpipe", ranks, ranks, microbatches, loop_placement(ranks, 1), actions)


def one_f_one_b(ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): warm up, alternate, cool down.

    Rank ``r`` runs ``min(p - 1 - r, m)`` warm-up forwards, then one forward
    and one backward in turn, then the remaining backwards. It has GPipe's
    bubble, ``(p - 1) / (m + p - 1)`` at F = 1, B = 2, with at most
    ``min(p - r, m)`` microbatches in flight on rank ``r`` (``p`` on rank 0).

    Args:
        ranks: Pipeline ranks ``p``; one stage each.
        microbatches: Microbatches ``m``.
        stages_per_rank: Must be 1 (checked by ``build``).

    Returns:
        The schedule.
    """
    actions = []
    for r in range(ranks):
        warmup = min(ranks - 1 - r, microbatches)
        row = [Action(r, Kind.F, j) for j in range(warmup)]
        for j in range(microbatches - warmup):
            row += [Action(r, Kind.F, warmup + j), Action(r, Kind.B, j)]
        row += [Action(r, Kind.B, j) for j in range(microbatches - warmup, microbatches)]
        actions.append(row)
    return Schedule("1f1b", ranks, ranks, microbatches, loop_placement(ranks, 1), actions)


def looped_bfs(ranks: int, microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Looped breadth-first (Lamy-Poirier 2023): each local stage's forwards, then backwards.

    Stage ``s`` lives on rank ``s % p``. A rank runs all microbatches of its
    first stage, then of its next, and so on; then the backwards of its stages
    from the last one down. With F = 1, B = 2 the bubble ratio is exactly
    ``1 - v m / (v max(m, p) + min(m, p) - 1)``, interleaved 1F1B's: for
    ``m >= p`` that is ``(p - 1) / (v m + p - 1)`` (a lap never waits for the
    previous one), for ``m < p`` each lap waits ``p - m`` steps. The price is
    memory: peak in-flight is ``v m``.

    Args:
        ranks: Pipeline ranks ``p``.
        microbatches: Microbatches ``m``.
        stages_per_rank: Stages per rank ``v``.

    Returns:
        The schedule.
    """
    placement = loop_placement(ranks, stages_per_rank)
    actions = []
    for r in range(ranks):
        local = [r + k * ranks for k in range(stages_per_rank)]
        row = [Action(s, Kind.F, j) for s in local for j in range(microbatches)]
        row += [Action(s, Kind.B, j) for s in reversed(local) for j in range(microbatches)]
        actions.append(row)
    return Schedule("looped-bfs", ranks, ranks * stages_per_rank, microbatches, placement, actions)
