"""Megatron's interleaved 1F1B (Narayanan et al. 2021): v model chunks per rank."""

from __future__ import annotations

from fastpipe.schedules._ir import Action, Kind, Schedule
from fastpipe.schedules._placement import loop_placement

__all__ = ["interleaved_1f1b"]


def interleaved_1f1b(ranks: int, microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B: 1F1B over ``v`` chunks per rank, chunk by chunk in groups of ``p``.

    Stage ``s`` lives on rank ``s % p``; local chunk ``k`` of rank ``r`` is
    stage ``k p + r``. Microbatches are taken in groups of ``p``; when ``p``
    does not divide ``m`` the remainder joins the *first* group, so that no
    group is shorter than the ``p``-step trip around the ranks between two
    chunks (a short group leaves ranks waiting; a long group late in the run
    pushes its last-chunk forwards past the backwards paired with them). A
    rank's forward order runs, group by group, chunk 0 over the group, then
    chunk 1 over it, and so on; its backward order is the same with the chunks
    reversed. Rank ``r`` first runs ``2 (p - 1 - r) + (v - 1) g`` forwards,
    ``g`` the first group's size (all forwards if there are fewer), then
    alternates one forward and one backward, then drains the backwards. With
    ``v = 1`` this is plain 1F1B (``p - 1 - r`` warm-up forwards).

    Bubble at F = 1 and B = 2 per stage (a stage is ``1/v`` of a rank's model),
    checked exactly for every ``p <= 8``, ``v <= 4``, ``m <= 32``: the makespan
    is ``3 (v max(m, p) + min(m, p) - 1)`` against ``3 v m`` of work per rank,
    so the bubble ratio is ``1 - v m / (v max(m, p) + min(m, p) - 1)``. For
    ``m >= p`` (any ``m``, not only multiples of ``p``) that is Megatron's
    ``(p - 1) / (v m + p - 1)``: the fill and the drain each cost ``p - 1``
    stage-steps and the steady state never waits. For ``m < p`` each chunk
    waits ``p - m`` steps for its first microbatch to come round. Peak
    in-flight on rank ``r`` is the warm-up count plus one, at most ``v m``.

    Args:
        ranks: Pipeline ranks ``p``.
        microbatches: Microbatches ``m`` (any ``m >= 1``).
        stages_per_rank: Chunks per rank ``v``.

    Returns:
        The schedule.
    """
    p, m, v = ranks, microbatches, stages_per_rank
    forwards = _chunk_order(p, m, v, reverse=False)
    backwards = _chunk_order(p, m, v, reverse=True)
    first_group = p + m % p if m >= p else m
    actions = []
    for r in range(p):
        # Megatron's warm-up: 2 (p - 1 - r) for the trip down and back, plus
        # the first group through every chunk but the last.
        warmup = p - 1 - r if v == 1 else 2 * (p - 1 - r) + (v - 1) * first_group
        warmup = min(warmup, v * m)
        fwd = [Action(k * p + r, Kind.F, j) for k, j in forwards]
        bwd = [Action(k * p + r, Kind.B, j) for k, j in backwards]
        row = fwd[:warmup]
        for f, b in zip(fwd[warmup:], bwd):
            row += [f, b]
        row += bwd[v * m - warmup :]
        actions.append(row)
    return Schedule("interleaved-1f1b", p, p * v, m, loop_placement(p, v), actions)


def _chunk_order(p: int, m: int, v: int, reverse: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) pairs: each group of microbatches through every chunk in turn."""
    chunks = range(v - 1, -1, -1) if reverse else range(v)
    first = p + m % p if m >= p else m  # the remainder joins the first group
    starts = [0, *range(first, m, p)]
    order = []
    for start, end in zip(starts, [*starts[1:], m]):
        order += [(k, j) for k in chunks for j in range(start, end)]
    return order
