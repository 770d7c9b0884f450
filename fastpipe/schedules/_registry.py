"""The registry: schedule names, their generators and the rules on their parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastpipe.schedules._costs import Costs

from fastpipe.schedules._gen_classic import gpipe, looped_bfs, one_f_one_b
from fastpipe.schedules._gen_dualpipe import dualpipev
from fastpipe.schedules._gen_interleaved import interleaved_1f1b
from fastpipe.schedules._gen_zero_bubble import zb_h1, zb_h2, zbv
from fastpipe.schedules._ir import Schedule

__all__ = ["build", "names", "orders_by_cost"]

Generator = Callable[[int, int, int], Schedule]


@dataclass(frozen=True)
class _Entry:
    generator: Generator
    default_v: int
    fixed_v: bool  # True: stages_per_rank must equal default_v
    by_cost: bool = False  # True: the generator orders its actions by given costs


_REGISTRY: dict[str, _Entry] = {
    "gpipe": _Entry(gpipe, 1, True),
    "1f1b": _Entry(one_f_one_b, 1, True),
    "interleaved-1f1b": _Entry(interleaved_1f1b, 2, False),
    "looped-bfs": _Entry(looped_bfs, 2, False),
    "zb-h1": _Entry(zb_h1, 1, True, by_cost=True),
    "zb-h2": _Entry(zb_h2, 1, True, by_cost=True),
    "zbv": _Entry(zbv, 2, True, by_cost=True),
    "dualpipev": _Entry(dualpipev, 2, True),
}


def names() -> list[str]:
    """The registered schedule names, in registration order.

    Example:
        >>> names()[:2]
        ['gpipe', '1f1b']
    """
    return list(_REGISTRY)


def orders_by_cost(name: str) -> bool:
    """Whether ``build(name, ..., costs=...)`` orders the actions by the
    costs: the zero-bubble schedules, whose lists come from a list scheduler.
    The others have a fixed order, whatever the costs."""
    return name in _REGISTRY and _REGISTRY[name].by_cost


def build(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None,
          costs: Costs | None = None, latency: float = 0.0, lean: bool = False,
          sizes: Sequence[tuple[float, float]] | None = None) -> Schedule:
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
        costs: zero-bubble schedules only (:func:`orders_by_cost`): the
            actions' costs as :meth:`Schedule.simulate` takes them (per kind,
            per stage, or a callable), e.g. a profile's F, I and W sums per
            stage. The list scheduler then orders each rank's actions by
            them instead of by F = I = W: where W is much cheaper than F, the
            unit-cost order keeps forwards waiting for W slots that end long
            before the next input arrives. ``None``: unit costs.
        latency: with ``costs``, the time a value takes to reach another rank.
        lean: zero-bubble schedules only: the cap on microbatches between F
            and W is the one between F and I, so what W reads adds no
            microbatch to the peak (1F1B's count for zb-h1 and zbv), for some
            of the bubble the extra W slots filled (``fastpipe.plan`` weighs
            the two under a ``memory_limit``). As every cap of the list
            scheduler, it gives way where keeping it would stall every rank
            (``fastpipe.schedules._greedy``; seen with latency or costs).
        sizes: with ``lean``: per stage, the bytes one microbatch holds from
            F to I (its saved activations) and from I to W (what W reads),
            e.g. a profile's. The lean cap then counts bytes: no rank holds
            more than its F-to-I cap's activations, whichever state its
            microbatches are in, so W that reads little may wait longer and
            a heavy one (a vocabulary head's) runs sooner. Every size equal
            gives the count-capped lean order.

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
    if not isinstance(lean, bool):
        raise ValueError(f"lean must be a bool, got {lean!r} (schedule {name!r})")
    if sizes is not None:
        sizes = _check_sizes(sizes, lean, v * ranks, name)
    if costs is None and latency == 0.0 and not lean:
        return entry.generator(ranks, microbatches, v)
    if not entry.by_cost:
        ordered = ", ".join(n for n, e in _REGISTRY.items() if e.by_cost)
        raise ValueError(f"schedule {name!r} has a fixed order; costs, latency and lean apply "
                         f"only to {ordered}")
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not latency >= 0:
        raise ValueError(f"latency must be a number >= 0, got {latency!r}")
    extra = {} if sizes is None else {"sizes": sizes}
    return entry.generator(ranks, microbatches, v, costs=costs, latency=float(latency), lean=lean,
                           **extra)


def _check_sizes(sizes, lean: bool, stages: int, name: str) -> list[tuple[float, float]]:
    """``sizes`` as a list of (F-to-I, I-to-W) byte pairs, one per stage."""
    if not lean:
        raise ValueError(f"sizes apply to lean orders only: pass lean=True (schedule {name!r})")
    try:
        pairs = [(float(a), float(b)) for a, b in sizes]
    except (TypeError, ValueError):
        raise ValueError(f"sizes must hold one (F-to-I bytes, I-to-W bytes) pair per stage, "
                         f"got {sizes!r} (schedule {name!r})") from None
    if len(pairs) != stages:
        raise ValueError(f"sizes must hold one pair per stage ({stages}), got {len(pairs)} "
                         f"(schedule {name!r})")
    bad = [pair for pair in pairs if not all(0 <= x < float("inf") for x in pair)]
    if bad:
        raise ValueError(f"sizes must be finite byte counts >= 0, got {bad[0]!r} (schedule {name!r})")
    return pairs


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
