"""Tied parameters: one parameter used by layers of several stages.

Language models tie the input embedding to the output projection, and a
block reused at two depths shares all its weights. The unsplit model's
backward sums every use's gradient into one ``.grad``; a pipeline must do
the same, whichever ranks the uses run on:

- uses on one rank (V placement puts stage 0 and the last stage on rank 0)
  share the parameter object, and each stage's backward (autograd's, or a
  chain's, which reads ``.grad`` when it adds to it) accumulates into it in
  turn, on the rank's one thread;
- uses on several ranks in distributed mode hold a copy each (every
  process built the whole model). After the step each rank's share of the
  gradient is summed over the pipeline group, one ``all_reduce`` per
  dtype, so every rank that uses the parameter ends the step with the full
  gradient and, stepping its optimizer like the others, keeps its copy in
  step with theirs (what Megatron does for tied embeddings);
- uses on several ranks in local mode (threads of one process, possibly on
  different devices): the first rank runs the parameter itself; every other
  rank gets a replica on its own device, copied from the parameter and
  swapped into that rank's modules for the call (``LocalTies``), so no two
  threads add into one ``.grad``; after a step the replicas' gradients are
  added to the parameter's. A module that stages of two ranks both run
  cannot hold both, and is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fastpipe.runtime.transport.base import PeerError
from fastpipe.runtime.transport.groups import all_reduce

__all__ = ["LocalTies", "Tie", "TiedGrads", "check_local", "find_ties"]


@dataclass
class Tie:
    """A parameter that layers of more than one stage use.

    Attributes:
        name: Its name in ``model.named_parameters()`` (the first use).
        param: The parameter, as this process holds it.
        stages: The stages whose layers use it, in increasing order.
        ranks: The ranks holding those stages, in increasing order.
    """

    name: str
    param: nn.Parameter
    stages: tuple[int, ...]
    ranks: tuple[int, ...]


def find_ties(model: nn.Sequential, ranges: Sequence[range], stage_to_rank: Sequence[int]) -> list[Tie]:
    """Every parameter used by layers of two or more stages, in the model's parameter order."""
    names = {id(p): n for n, p in model.named_parameters()}
    layers = list(model)
    users: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for stage, layer_range in enumerate(ranges):
        for i in layer_range:
            for p in layers[i].parameters():
                users.setdefault(id(p), (p, set()))[1].add(stage)
    ties = []
    for key, (p, stages) in users.items():
        if len(stages) > 1:
            held = tuple(sorted(stages))
            ties.append(Tie(names[key], p, held, tuple(sorted({stage_to_rank[s] for s in held}))))
    order = list(names)
    return sorted(ties, key=lambda t: order.index(id(t.param)))


def check_local(ties: Sequence[Tie], model: nn.Sequential, ranges: Sequence[range],
                stage_to_rank: Sequence[int]) -> None:
    """Local mode: a tie across ranks must be between different modules.

    Each rank but the first runs the tie on a replica swapped into its own
    modules' tables (``LocalTies``); a module that stages of two ranks both
    run (one module placed twice) cannot hold the original and a replica at
    once.

    Raises:
        ValueError: naming the parameter, the module and the ranks.
    """
    layers = list(model)
    for tie in ties:
        if len(tie.ranks) < 2:
            continue
        owners: dict[int, tuple[nn.Module, set[int]]] = {}
        for stage in tie.stages:
            for i in ranges[stage]:
                for m in layers[i].modules():
                    if any(q is tie.param for q in m._parameters.values()):
                        owners.setdefault(id(m), (m, set()))[1].add(stage_to_rank[stage])
        for m, ranks in owners.values():
            if len(ranks) > 1:
                raise ValueError(
                    f"parameter {tie.name!r} belongs to one {type(m).__name__} module that stages "
                    f"on ranks {_listed(sorted(ranks))} both run: in local mode a parameter shared "
                    "across ranks must be shared between different modules (as in "
                    "head.weight = embedding.weight), each run by one rank; choose balance= so "
                    "the module's uses fall on one rank, or use distributed mode")


def _listed(values: Sequence[int]) -> str:
    *head, last = map(str, values)
    return f"{', '.join(head)} and {last}" if head else last


class TiedGrads:
    """Sums the gradients of parameters tied across ranks over the pipeline group.

    ``begin()`` before a step sets each tied ``.grad`` this rank uses aside,
    so that the step accumulates only its own share into a fresh one;
    ``reduce()`` after it sums the shares of every rank and adds the sum to
    what was set aside (``.grad`` accumulates over steps as with
    ``backward``). A parameter no rank produced a gradient for keeps
    ``.grad`` as it was, None included, as the unsplit backward would.

    Every rank of the group calls both, in the same order; ranks that do not
    use a tie contribute zeros (they may hold it on the meta device, with
    ``free_remote``).

    Args:
        ties: The ties across ranks (``len(tie.ranks) > 1``), the same list on every rank.
        rank: This process's pipeline rank.
        device: Where this rank's reduction buffers live (its device: NCCL needs a GPU).
        group: The pipeline's process group.
    """

    def __init__(self, ties: Sequence[Tie], rank: int, device: torch.device,
                 group: dist.ProcessGroup | None) -> None:
        self.ties = [t for t in ties if t.param.requires_grad]
        self.rank = rank
        self.device = device
        self.group = group
        self._aside: dict[int, torch.Tensor | None] = {}

    def __bool__(self) -> bool:
        return bool(self.ties)

    def _mine(self, tie: Tie) -> bool:
        return self.rank in tie.ranks

    def begin(self) -> None:
        self._aside = {}
        for i, tie in enumerate(self.ties):
            if self._mine(tie):
                self._aside[i] = tie.param.grad
                tie.param.grad = None

    def restore(self) -> None:
        """After a failed step: ``.grad`` as it was before it (the share is dropped)."""
        for i, grad in self._aside.items():
            self.ties[i].param.grad = grad
        self._aside = {}

    def reduce(self, failed: bool = False, timeout: float | None = None) -> None:
        """Sums the step's shares over the group into ``.grad``.

        ``failed``: this rank's step failed after its last message, so the
        others reached this call: it takes part with no share and a flag
        that makes them fail too (their ``.grad`` as before the step),
        waiting at most ``timeout`` seconds.

        Raises:
            PeerError: another rank took part with ``failed``.
        """
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, tie in enumerate(self.ties):
            by_dtype.setdefault(tie.param.dtype, []).append(i)
        ranks = dist.get_world_size(self.group)
        totals = []
        for dtype, indices in by_dtype.items():
            # One buffer per dtype: each tie's share, one flag per tie (1
            # where this rank produced a gradient), one per rank (1: its step
            # failed), summed over ranks.
            sizes = [self.ties[i].param.numel() for i in indices]
            flat = torch.zeros(sum(sizes) + len(indices) + ranks, dtype=dtype, device=self.device)
            offset = 0
            for k, (i, size) in enumerate(zip(indices, sizes)):
                grad = self.ties[i].param.grad if self._mine(self.ties[i]) and not failed else None
                if grad is not None:
                    flat[offset : offset + size].copy_(grad.reshape(-1))
                    flat[sum(sizes) + k] = 1
                offset += size
            if failed:
                flat[sum(sizes) + len(indices) + self.rank] = 1
            all_reduce(flat, group=self.group, timeout=timeout if failed else None)
            totals.append((indices, sizes, flat))
        if failed:
            return
        for indices, sizes, flat in totals:
            gone = [r for r, f in enumerate(flat[sum(sizes) + len(indices):].tolist()) if f > 0]
            if gone:
                raise PeerError(f"pipeline rank {gone[0]} failed after its last message of the "
                                "step (its own error says why)")
        for indices, sizes, flat in totals:
            flags = flat[sum(sizes):].tolist()
            offset = 0
            for k, (i, size) in enumerate(zip(indices, sizes)):
                tie = self.ties[i]
                if self._mine(tie):
                    self._settle(i, tie, flat[offset : offset + size], flags[k] > 0)
                offset += size
        self._aside = {}

    def _settle(self, i: int, tie: Tie, total: torch.Tensor, produced: bool) -> None:
        p, aside = tie.param, self._aside.get(i)
        if not produced:
            p.grad = aside
            return
        total = total.view_as(p)
        if aside is not None:
            p.grad = aside.add_(total.to(aside.device))
        elif p.grad is not None:
            p.grad.copy_(total)
        else:
            p.grad = total.to(p.device).clone()


class LocalTies:
    """Local mode: the replicas of parameters tied across ranks.

    The parameter stays with the first rank that uses it (moved back to its
    device if building a later rank's stage moved it). ``swapped()`` wraps
    one call: it copies each parameter into its replicas, puts them into the
    other ranks' modules, and puts the parameters back when the call ends,
    so between calls the model is the user's as built. ``gather()`` (after a
    step that succeeded) adds the replicas' gradients into the parameters'.
    Tensor hooks on a tied parameter see its first rank's gradient only.

    Args:
        ties: The ties across ranks.
        stages: ``{rank: {stage index: Stage}}``, as the pipe built them.
        devices: Each rank's device.
    """

    def __init__(self, ties: Sequence[Tie], stages: dict, devices: Sequence[torch.device]) -> None:
        self._stages = [st for held in stages.values() for st in held.values()]
        # (parameter, replica, [(module, name) whose entry the replica takes])
        self._swaps: list[tuple[nn.Parameter, nn.Parameter, list[tuple[nn.Module, str]]]] = []
        for tie in ties:
            p, home = tie.param, devices[tie.ranks[0]]
            if p.device != home:
                with torch.no_grad():
                    p.data = p.data.to(home)
                    if p.grad is not None:
                        p.grad = p.grad.to(home)
            for rank in tie.ranks[1:]:
                slots = {(id(m), name): (m, name) for st in stages[rank].values()
                         for m in st.module.modules() for name, q in m._parameters.items() if q is p}
                replica = nn.Parameter(torch.empty_like(p, device=devices[rank]))
                self._swaps.append((p, replica, list(slots.values())))

    @contextmanager
    def swapped(self) -> Iterator[None]:
        with torch.no_grad():
            for p, replica, slots in self._swaps:
                replica.copy_(p)
                replica.requires_grad_(p.requires_grad)
                for m, name in slots:
                    m._parameters[name] = replica
        self._refresh()
        try:
            yield
        finally:
            for p, replica, slots in self._swaps:
                replica.grad = None  # gathered by now, or a failed step's
                for m, name in slots:
                    m._parameters[name] = p
            self._refresh()

    def gather(self) -> None:
        """Adds each replica's gradient into its parameter's ``.grad``."""
        with torch.no_grad():
            for p, replica, _ in self._swaps:
                grad, replica.grad = replica.grad, None
                if grad is None:
                    continue
                grad = grad.to(p.device)  # the replica's own gradient: nothing else holds it
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad.add_(grad)

    def _refresh(self) -> None:
        for st in self._stages:
            st.refresh()
