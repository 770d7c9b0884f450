"""CSV interop with torch.distributed.pipelining (``_dump_csv`` / ``_load_csv``).

The format: one row per rank, one cell per action string (``0F0``, ``2I1``,
``0SEND_F1``), written by Python's ``csv`` module with its default dialect.
torch leaves a cell empty for an idle step, and its DualPipeV writes
overlapped pairs as ``(0F7;7B3)OVERLAP_F_B``. fastpipe's lists have no idle
slots, so an empty cell reads as nothing and an overlap cell as its
sub-actions in order; each row that ``load_csv`` returns also remembers its
cell layout (the cell each action came from, and the row's cell count), and
``save_csv`` writes a row with its layout back into the same cells. A file
loaded and saved again is therefore the same file. Rows without a layout
(built, lowered, or loaded and then resized) get one action per cell. The
FSDP actions of torch's ``compute_comms`` files (``UNSHARD``, ``RESHARD``,
``REDUCE_GRAD``) are not part of this IR and are rejected.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

from fastpipe.schedules._ir import Action, Schedule

__all__ = ["load_csv", "save_csv"]

logger = logging.getLogger(__name__)

_OVERLAP = "OVERLAP_F_B"


def save_csv(schedule: Schedule, path: str | Path) -> Path:
    """Write ``schedule`` in torch's CSV format, one row per rank.

    A row read by :func:`load_csv` goes back into the cells it came from
    (idle and overlap cells included); any other row gets one action per cell.

    Args:
        schedule: Compute-only (torch's ``compute_only``) or lowered
            (``compute_comms``).
        path: The file to write.

    Returns:
        ``path`` as a ``Path``.

    Example:
        >>> import tempfile, os
        >>> from fastpipe.schedules import build
        >>> path = save_csv(build("1f1b", 2, 2), os.path.join(tempfile.mkdtemp(), "s.csv"))
        >>> path.read_text().splitlines()
        ['0F0,0F1,0B0,0B1', '1F0,1B0,1F1,1B1']
    """
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        for row in schedule.actions:
            writer.writerow(_cells(row))
    return path


def load_csv(path: str | Path, name: str | None = None) -> Schedule:
    """Read a schedule from torch's CSV format, inferring its sizes and placement.

    ``ranks`` is the number of rows, ``stages`` and ``microbatches`` one more
    than the largest index seen, and stage ``s`` lives on the rank whose row
    holds its actions. ``load_csv(save_csv(s, p), name=s.name) == s``, and
    ``save_csv(load_csv(p), q)`` writes ``q`` byte for byte like ``p`` (for a
    file in the format's dialect: no spaces around actions, ``\\r\\n`` line ends).

    Args:
        path: The file to read.
        name: The schedule's name; defaults to the file's stem.

    Returns:
        The schedule (lowered if the file holds communication actions). It is
        not validated: call ``validate()``.

    Raises:
        ValueError: For a cell that is not an action (naming the file, row and
            column), an empty file, a stage found in two rows, or a stage
            index with no actions at all.
    """
    path = Path(path)
    with path.open(newline="") as f:
        actions = [_read_row(row, path, r) for r, row in enumerate(csv.reader(f))]
    if not actions:
        raise ValueError(f"{path}: no rows, so no ranks")
    stage_to_rank = _placement(actions, path)
    microbatches = 1 + max(a.microbatch for row in actions for a in row)
    return Schedule(
        name=path.stem if name is None else name,
        ranks=len(actions),
        stages=len(stage_to_rank),
        microbatches=microbatches,
        stage_to_rank=stage_to_rank,
        actions=actions,
    )


class _Row(list[Action]):
    """A rank's actions as read from a file, with the cell each one came from.

    It compares equal to the plain list of its actions; ``columns[i]`` is the
    cell of ``self[i]`` (an overlap cell gives its sub-actions one column) and
    ``width`` the row's cell count, so the cells between are the idle ones.
    """

    def __init__(self, actions: list[Action], columns: list[int], width: int) -> None:
        super().__init__(actions)
        self.columns = tuple(columns)
        self.width = width


def _read_row(row: list[str], path: Path, r: int) -> _Row:
    actions: list[Action] = []
    columns: list[int] = []
    for c, cell in enumerate(row):
        parsed = _parse_cell(cell, path, r, c)
        actions += parsed
        columns += [c] * len(parsed)
    return _Row(actions, columns, len(row))


def _cells(row: list[Action]) -> list[str]:
    """The row's CSV cells: back where they were read from, else one action per cell."""
    if not isinstance(row, _Row) or len(row.columns) != len(row):
        return [str(a) for a in row]
    cells: list[list[str]] = [[] for _ in range(row.width)]
    for a, c in zip(row, row.columns):
        cells[c].append(str(a))
    return [f"({';'.join(cell)}){_OVERLAP}" if len(cell) > 1 else "".join(cell) for cell in cells]


def _parse_cell(cell: str, path: Path, row: int, column: int) -> list[Action]:
    text = cell.strip()
    if not text:
        return []  # an idle step in torch's padded lists
    try:
        if text.startswith("(") and text.endswith(")" + _OVERLAP):
            inner = text[1 : -len(_OVERLAP) - 1]
            logger.debug("%s: reading %s as its sub-actions in order", path, text)
            return [Action.parse(part) for part in inner.split(";") if part.strip()]
        return [Action.parse(text)]
    except ValueError as exc:
        raise ValueError(f"{path}: row {row} (rank {row}), column {column}: {exc}") from exc


def _placement(actions: list[list[Action]], path: Path) -> tuple[int, ...]:
    owner: dict[int, int] = {}
    for rank, row in enumerate(actions):
        for a in row:
            if owner.setdefault(a.stage, rank) != rank:
                raise ValueError(
                    f"{path}: stage {a.stage} has actions on ranks {owner[a.stage]} and {rank}; "
                    "a stage must live on one rank"
                )
    if not owner:
        raise ValueError(f"{path}: no actions, so no stages")
    stages = 1 + max(owner)
    absent = [s for s in range(stages) if s not in owner]
    if absent:
        raise ValueError(f"{path}: stages {absent} have no actions, so no rank to live on")
    return tuple(owner[s] for s in range(stages))
