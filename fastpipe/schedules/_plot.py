"""PNG timeline of a simulation (matplotlib, imported only when drawing)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastpipe.schedules._simulate import Simulation, TimelineRecord

__all__ = ["plot"]

# Forward blue, full backward green, input backward orange, weight backward purple.
COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#dd8452", "W": "#8172b3"}
COMM_COLOR = "#999999"


def plot(sim: Simulation, path: str | Path) -> Path:
    """Draw ``sim``'s timeline, one row per rank, and save it as a PNG.

    Each compute action is a box colored by kind and labelled with its
    microbatch; on ranks that hold several stages, later local stages are
    drawn lighter. Transfers, when the simulation had a P2P model, are thin
    grey bars under their sender's row.

    Args:
        sim: A simulation.
        path: The PNG to write.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ImportError: If matplotlib is not installed (``pip install fastpipe[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("Simulation.plot needs matplotlib: pip install fastpipe[plot]") from exc
    schedule = sim.schedule
    shade = _shades(sim)
    width = min(max(6.0, sim.makespan * 0.25), 60.0)
    fig, ax = plt.subplots(figsize=(width, 0.6 * schedule.ranks + 1.5))
    for rec in sim.timeline:
        _draw(ax, rec, shade)
    _decorate(ax, sim)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _shades(sim: Simulation) -> dict[int, float]:
    """Per stage, the box opacity: 1 for a rank's first stage, lighter for later ones."""
    schedule = sim.schedule
    per_rank = [schedule.stages_of(r) for r in range(schedule.ranks)]
    chunks = max(len(stages) for stages in per_rank)
    return {
        s: 1.0 - 0.45 * k / max(chunks - 1, 1) for stages in per_rank for k, s in enumerate(stages)
    }


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


def _decorate(ax: Any, sim: Simulation) -> None:
    from matplotlib.patches import Patch

    schedule = sim.schedule
    ax.set_yticks(range(schedule.ranks), [f"rank {r}" for r in range(schedule.ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time (cost units)")
    ax.set_title(
        f"{schedule.name}: {schedule.ranks} ranks, {schedule.microbatches} "
        f"microbatches, bubble {sim.bubble_ratio:.1%}, makespan {sim.makespan:g}"
    )
    kinds = {rec.action.kind.value for rec in sim.timeline if rec.track == "compute"}
    handles = [Patch(color=COLORS[k], label=k) for k in "FBIW" if k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
