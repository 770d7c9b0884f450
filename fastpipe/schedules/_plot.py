"""A simulation's timeline on a matplotlib Figure (imported only when drawing, never pyplot)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from fastpipe.schedules._simulate import Simulation, TimelineRecord

__all__ = ["plot"]

# Forward blue, full backward green, input backward orange, weight backward purple.
COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#dd8452", "W": "#8172b3"}
KIND_LABELS = {"F": "F forward", "B": "B backward", "I": "I input grad", "W": "W weight grad"}
COMM_COLOR = "#999999"
SHADE_COLOR = "#555555"


def plot(
    sim: Simulation,
    path: str | Path | None = None,
    ax: Axes | None = None,
    *,
    unit: str = "cost units",
) -> Figure:
    """Draw ``sim``'s timeline, one row per rank, and save it when ``path`` is given.

    Each compute action is a box colored by kind and labelled with its
    microbatch; on ranks that hold several stages, later local stages are
    drawn lighter. Communication records, when there are any, are thin grey
    bars under their rank's row. The legend names the kinds, the stage shades
    and the communication bars drawn. The figure is a plain
    ``matplotlib.figure.Figure``: neither pyplot nor the session's backend
    is touched.

    Args:
        sim: A simulation (or a measured step, see ``fastpipe.runtime.timeline``).
        path: Where to save the figure (the format follows the suffix, e.g.
            ``.png``); ``None`` saves nothing.
        ax: The axes to draw on; ``None`` draws on a new figure sized to
            the timeline.
        unit: The unit of ``sim``'s times, for the axis label and the title.

    Returns:
        The figure drawn on (``ax.figure`` when ``ax`` was given).

    Raises:
        ImportError: If matplotlib is not installed (``pip install fastpipe[plot]``).
        TypeError: If ``ax`` is not a matplotlib ``Axes``.

    Example:
        >>> from fastpipe.schedules import build
        >>> fig = plot(build("1f1b", 2, 2).simulate())
        >>> fig.axes[0].get_xlabel()
        'time (cost units)'
    """
    try:
        from matplotlib import axes, figure
    except ImportError as exc:
        raise ImportError("Simulation.plot needs matplotlib: pip install fastpipe[plot]") from exc
    if ax is not None and not isinstance(ax, axes.Axes):
        raise TypeError(f"ax must be a matplotlib Axes, got {type(ax).__name__}: {ax!r}")
    own = ax is None
    if own:
        width = min(max(6.0, sim.makespan * 0.25), 60.0)
        ax = figure.Figure(figsize=(width, 0.6 * sim.schedule.ranks + 1.5)).add_subplot()
    shade = _shades(sim)
    for rec in sim.timeline:
        _draw(ax, rec, shade)
    _decorate(ax, sim, unit)
    fig = ax.figure
    if own:
        fig.tight_layout()  # a caller's figure keeps the caller's layout
    if path is not None:
        fig.savefig(Path(path), dpi=100)
    return fig


def _shades(sim: Simulation) -> dict[int, float]:
    """Per stage, the box opacity: 1 for a rank's first stage, lighter for later ones."""
    return {s: alpha for alpha, stages in _chunks(sim) for s in stages}


def _chunks(sim: Simulation) -> list[tuple[float, list[int]]]:
    """Per local stage index k, its opacity and the stages that are k-th on their rank."""
    schedule = sim.schedule
    per_rank = [schedule.stages_of(r) for r in range(schedule.ranks)]
    chunks = max(len(stages) for stages in per_rank)
    return [
        (1.0 - 0.45 * k / max(chunks - 1, 1), sorted(s[k] for s in per_rank if len(s) > k))
        for k in range(chunks)
    ]


def _draw(ax: Any, rec: TimelineRecord, shade: dict[int, float]) -> None:
    span = rec.end - rec.start
    if rec.track == "comm":
        ax.barh(rec.rank + 0.38, span, left=rec.start, height=0.08, color=COMM_COLOR)
        return
    alpha = shade[rec.action.stage]
    color = COLORS[rec.action.kind.value]
    ax.barh(rec.rank, span, left=rec.start, height=0.7, alpha=alpha, color=color,
            edgecolor="white", linewidth=0.5)  # fmt: skip
    ax.text(rec.start + span / 2, rec.rank, str(rec.action.microbatch), ha="center",
            va="center", fontsize=7, color="white" if alpha > 0.8 else "black")  # fmt: skip


def _decorate(ax: Any, sim: Simulation, unit: str) -> None:
    from matplotlib.patches import Patch

    schedule = sim.schedule
    ax.set_yticks(range(schedule.ranks), [f"rank {r}" for r in range(schedule.ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(
        f"{schedule.name}: {schedule.ranks} ranks, {schedule.microbatches} microbatches\n"
        f"bubble {sim.bubble_ratio:.1%}, makespan {_number(sim.makespan)} {unit}"
    )
    kinds = {rec.action.kind.value for rec in sim.timeline if rec.track == "compute"}
    handles = [Patch(color=COLORS[k], label=KIND_LABELS[k]) for k in "FBIW" if k in kinds]
    chunks = _chunks(sim)
    if len(chunks) > 1:  # one shade needs no key
        handles += [
            Patch(color=SHADE_COLOR, alpha=alpha, label=f"stages {_stages(stages)}")
            for alpha, stages in chunks
        ]
    if any(rec.track == "comm" for rec in sim.timeline):
        handles.append(Patch(color=COMM_COLOR, label="communication"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def _number(x: float) -> str:
    """Three significant digits, without an exponent from 0.0001 up."""
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def _stages(stages: list[int]) -> str:
    """``0-3`` for a run of consecutive stages, else ``0, 3, 4``."""
    if len(stages) > 2 and stages == list(range(stages[0], stages[-1] + 1)):
        return f"{stages[0]}-{stages[-1]}"
    return ", ".join(map(str, stages))
