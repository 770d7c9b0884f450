"""The registry: schedule names, their generators and the rules on their parameters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastpipe.schedules._gen_classic import gpipe, looped_bfs, one_f_one_b
from fastpipe.schedules._gen_dualpipe import dualpipev
from fastpipe.schedules._gen_interleaved import interleaved_1f1b
from fastpipe.schedules._gen_zero_bubble import zb_h1, zb_h2, zbv
from fastpipe.schedules._ir import Schedule

__all__ = ["build", "names"]

Generator = Callable[[int, int, int], Schedule]


@dataclass(frozen=True)
class _Entry:
    generator: Generator
    default_v: int
    fixed_v: bool  # True: stages_per_rank must equal default_v


_REGISTRY: dict[str, _Entry] = {
    "gpipe": _Entry(gpipe, 1, True),
    "1f1b": _Entry(one_f_one_b, 1, True),
    "interleaved-1f1b": _Entry(interleaved_1f1b, 2, False),
    "looped-bfs": _Entry(looped_bfs, 2, False),
    "zb-h1": _Entry(zb_h1, 1, True),
    "zb-h2": _Entry(zb_h2, 1, True),
    "zbv": _Entry(zbv, 2, True),
    "dualpipev": _Entry(dualpipev, 2, True),
}


def names() -> list[str]:
    """The registered schedule names, in registration order.

    Example:
        >>> names()[:2]
        ['gpipe', '1f1b']
    """
    return list(_REGISTRY)


def build(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """Generate the schedule ``name`` for ``ranks`` ranks and ``microbatches`` microbatches.

    Args:
        name: One of :func:`names`.
        ranks: Pipeline ranks, >= 1.
        microbatches: Microbatches, >= 1. Every schedule accepts any number,
            fewer than ``ranks`` included (with a larger bubble).
        stages_per_rank: Stages (model chunks) per rank. ``None`` takes the
            schedule's default: 1 for gpipe, 1f1b, zb-h1 and zb-h2 (which only
            take 1), 2 for interleaved-1f1b and looped-bfs (which take any
            value >= 1) and for zbv and dualpipev (which only take 2).

    Returns:
        The compute-only schedule; stage ``s`` of an interleaved or looped
        schedule lives on rank ``s % ranks``, of a V schedule on rank
        ``s`` or ``2 * ranks - 1 - s``.

    Raises:
        ValueError: For an unknown name (the message lists the valid ones) or
            parameters the schedule cannot take (the message names the rule).

    Example:
        >>> build("interleaved-1f1b", 4, 8, stages_per_rank=2).stages
        8
    """
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(names())}")
    for label, value in (("ranks", ranks), ("microbatches", microbatches)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{label} must be an int >= 1, got {value!r} (schedule {name!r})")
    v = entry.default_v if stages_per_rank is None else stages_per_rank
    if not _is_int(v) or v < 1:
        raise ValueError(f"stages_per_rank must be an int >= 1, got {v!r} (schedule {name!r})")
    if entry.fixed_v and v != entry.default_v:
        raise ValueError(
            f"schedule {name!r} has exactly {entry.default_v} stage(s) per rank, got "
            f"stages_per_rank={v}; pass {entry.default_v} or None"
        )
    return entry.generator(ranks, microbatches, v)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
