"""Chrome / Perfetto trace export of a simulated timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastpipe.schedules._simulate import Simulation

__all__ = ["to_chrome_trace"]

COMPUTE_TID, COMM_TID = 0, 1


def to_chrome_trace(sim: Simulation, path: str | Path, us_per_unit: float = 1000.0) -> Path:
    """Write ``sim``'s timeline as Chrome trace-event JSON (``{"traceEvents": [...]}``).

    One process (``pid``) per rank, named ``rank N``; thread 0 is its compute
    track and thread 1 its communication track (a send's flight). Open the
    file in https://ui.perfetto.dev or chrome://tracing.

    Args:
        sim: A simulation.
        path: The file to write.
        us_per_unit: Microseconds per cost unit; the default reads costs as
            milliseconds. Pass 1.0 if the costs are already in microseconds.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: If ``us_per_unit`` is not positive.
    """
    if not us_per_unit > 0:
        raise ValueError(f"us_per_unit must be > 0, got {us_per_unit!r}")
    events: list[dict[str, Any]] = []
    for rank in range(sim.schedule.ranks):
        events.append(_meta("process_name", rank, None, f"rank {rank}"))
        events.append(_meta("process_sort_index", rank, None, rank))
        events.append(_meta("thread_name", rank, COMPUTE_TID, "compute"))
        events.append(_meta("thread_name", rank, COMM_TID, "comm"))
    for rec in sim.timeline:
        events.append(
            {
                "name": str(rec.action),
                "cat": rec.action.kind.value,
                "ph": "X",
                "ts": rec.start * us_per_unit,
                "dur": (rec.end - rec.start) * us_per_unit,
                "pid": rec.rank,
                "tid": COMPUTE_TID if rec.track == "compute" else COMM_TID,
                "args": {"stage": rec.action.stage, "microbatch": rec.action.microbatch},
            }
        )
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def _meta(name: str, pid: int, tid: int | None, value: Any) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event
