"""The schedule IR: an action is ``1F0``, a schedule is one ordered action list per rank.

The string form of an action is torch.distributed.pipelining's: stage index,
kind, microbatch index, with nothing in between (``0F3``, ``2W1``,
``0SEND_F1``, ``1RECV_B2``). Communication actions carry the stage that does
the sending or receiving: stage 0's forward output of microbatch 1 leaves as
``0SEND_F1`` and arrives at stage 1 as ``1RECV_F1``; stage 1's input gradient
leaves as ``1SEND_B1`` and arrives at stage 0 as ``0RECV_B1``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from fastpipe.schedules._costs import Costs
    from fastpipe.schedules._simulate import Simulation

__all__ = ["Action", "Kind", "Schedule"]


class Kind(str, enum.Enum):
    """What an action does to its (stage, microbatch)."""

    F = "F"  # forward
    B = "B"  # full backward: input gradient and weight gradient
    I = "I"  # noqa: E741 - backward for the input only (the Zero Bubble "B")
    W = "W"  # backward for the weights only; needs I of the same (stage, mb)
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W; False for the four communication kinds."""
        return self in _COMPUTE

    @property
    def is_backward(self) -> bool:
        """True for the kinds that send a gradient to the previous stage: B and I."""
        return self in (Kind.B, Kind.I)


_COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
# Longest kinds first so that "SEND_F" is never read as stage "SEND" + "_F".
_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: ``kind`` applied to ``microbatch`` at ``stage``.

    Example:
        >>> str(Action(1, Kind.F, 0))
        '1F0'
        >>> Action.parse("0SEND_F1")
        Action(stage=0, kind=<Kind.SEND_F: 'SEND_F'>, microbatch=1)
    """

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read an action back from its string form.

        Args:
            text: A string such as ``"1F0"`` or ``"0SEND_F1"``; surrounding
                whitespace is ignored.

        Returns:
            The action.

        Raises:
            ValueError: If ``text`` is not ``<stage><kind><microbatch>`` with a
                kind among F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B.
        """
        match = _ACTION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                f"invalid action string {text!r}: expected <stage><kind><microbatch> "
                f"with kind one of {[k.value for k in Kind]}, e.g. '1F0' or '0SEND_F1'"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))


@dataclass
class Schedule:
    """A pipeline schedule: for each rank, the actions it runs, in order.

    Stage ``s`` forward consumes stage ``s - 1``'s output; stage 0 gets the
    input and stage ``stages - 1`` computes the loss. Each (stage, microbatch)
    has exactly one F and either one B or one I plus one W.

    A schedule that validates guarantees, within each rank's list: a stage's
    F comes before its I or B, I before its W, and a dependency on a stage of
    the same rank (V placement: stage ``p - 1`` feeds stage ``p`` on rank
    ``p - 1``) comes earlier. Lists from :func:`build` also take each stage's
    microbatches in increasing order for F, for B/I and for W.

    Attributes:
        name: The generator's registry name (or a file's name for a loaded CSV).
        ranks: Number of pipeline ranks.
        stages: Number of stages (ranks times stages per rank).
        microbatches: Number of microbatches.
        stage_to_rank: ``stage_to_rank[s]`` is the rank that holds stage ``s``.
        actions: ``actions[rank]`` in execution order; compute-only unless the
            schedule was lowered (see :func:`fastpipe.schedules.lower`).

    Raises:
        ValueError: If the sizes disagree (``len(stage_to_rank) != stages``,
            ``len(actions) != ranks``, or a rank outside ``range(ranks)``).
    """

    name: str
    ranks: int
    stages: int
    microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: list[list[Action]] = field(repr=False)

    def __post_init__(self) -> None:
        self.stage_to_rank = tuple(self.stage_to_rank)
        if len(self.stage_to_rank) != self.stages:
            raise ValueError(
                f"stage_to_rank and stages disagree (len(stage_to_rank): "
                f"{len(self.stage_to_rank)}, stages: {self.stages})"
            )
        if len(self.actions) != self.ranks:
            raise ValueError(
                f"actions must hold one list per rank (len(actions): "
                f"{len(self.actions)}, ranks: {self.ranks})"
            )
        bad = [r for r in self.stage_to_rank if not 0 <= r < self.ranks]
        if bad:
            raise ValueError(f"stage_to_rank names ranks outside range({self.ranks}): {bad}")

    def stages_of(self, rank: int) -> list[int]:
        """The stages that live on ``rank``, in increasing order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    @property
    def is_lowered(self) -> bool:
        """True if any rank's list holds communication actions."""
        return any(not a.kind.is_compute for acts in self.actions for a in acts)

    def validate(self) -> None:
        """Check that the schedule is complete, well ordered and deadlock free.

        Raises:
            ScheduleError: On the first problem found; the message shows the
                schedule's grid with the offending action marked ``>...<``.
        """
        from fastpipe.schedules._validate import validate

        validate(self)

    def simulate(
        self,
        costs: Costs | None = None,
        *,
        rank_speed: Sequence[float] | None = None,
        latency: float = 0.0,
        bandwidth: float | None = None,
        message_bytes: float | Callable[[Action], float] = 0.0,
    ) -> Simulation:
        """Run the schedule on a model of time; see :func:`fastpipe.schedules.simulate`."""
        from fastpipe.schedules._simulate import simulate

        return simulate(
            self,
            costs,
            rank_speed=rank_speed,
            latency=latency,
            bandwidth=bandwidth,
            message_bytes=message_bytes,
        )

    def render_text(self, by: Literal["time", "list"] = "time") -> str:
        """The rank x step grid; see :func:`fastpipe.schedules._render.render_text`."""
        from fastpipe.schedules._render import render_text

        return render_text(self, by=by)

    def lowered(self) -> Schedule:
        """This schedule with communication actions inserted (see ``lower``)."""
        from fastpipe.schedules._lower import lower

        return lower(self)

    def save_csv(self, path: str | Path) -> Path:
        """Write the schedule as torch.distributed.pipelining's CSV (see ``save_csv``)."""
        from fastpipe.schedules._csv import save_csv

        return save_csv(self, path)
