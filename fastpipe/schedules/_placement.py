"""Where stages live: the loop placement and the V placement."""

from __future__ import annotations

__all__ = ["loop_placement", "v_placement"]


def loop_placement(ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % ranks`` (GPipe, 1F1B, interleaved, looped BFS).

    Example:
        >>> loop_placement(2, 2)
        (0, 1, 0, 1)
    """
    return tuple(s % ranks for s in range(ranks * stages_per_rank))


def v_placement(ranks: int) -> tuple[int, ...]:
    """Rank ``r`` holds stages ``r`` and ``2 * ranks - 1 - r`` (ZB-V, DualPipeV).

    The model goes down the ranks and comes back up, so the first and the last
    stage share rank 0 and the two middle stages share the last rank.

    Example:
        >>> v_placement(3)
        (0, 1, 2, 2, 1, 0)
    """
    return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks))
