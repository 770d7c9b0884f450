"""Data parallelism across pipelines: replicas of one pipeline on a ``("dp", "pp")`` mesh.

Each data-parallel replica runs the whole pipeline over its own shard of
the batch; rank ``r`` of every replica holds the same stages. After a step
the replicas average what they computed over the ``dp`` group, rank by
rank: the gradients of the parameters that rank holds (so each replica ends
the step with the gradient of the mean loss over the global batch, as the
unsplit model over all shards would) and the loss. Gradients go in buckets
of about ``BUCKET_BYTES`` per dtype and device (as DDP buckets them); a
stage's start as soon as its last backward of the step has run, so a rank
that holds several stages (V and interleaved schedules) averages one
while it computes the others, and all are waited for at the end.

Before the replicas' first step their weights are compared (``differing``):
replicas that start apart stay apart, silently, since each applies the same
averaged update to different weights.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpipe.runtime.transport.groups import all_reduce, finish, started

__all__ = ["BUCKET_BYTES", "GradAverage", "check_weights", "differing"]

BUCKET_BYTES = 25 * 2**20


class GradAverage:
    """Averages gradients and the loss over the data-parallel group, each
    stage's gradients as soon as its step's last backward has run.

    Per step: ``begin()``; ``stage_done(s)`` as each stage's gradients are
    final (from the executor, while the rank goes on with its other
    stages); then ``average(loss)``, or ``fail()`` if the step failed. Every
    rank of the ``dp`` group holds the same stages and runs the same
    schedule, so all issue the same collectives in the same order. A
    parameter that no replica produced a gradient for keeps ``.grad`` as it
    was; one that some replicas did not touch counts zeros from them.

    Args:
        stages: This rank's stages' parameters, by stage index.
        order: The stage indices in the order their gradients complete.
        late: ids of parameters whose gradients change after the step
            (tied across pipeline ranks: summed over the pipeline group
            first); averaged in ``average``.
        group: The ``dp`` process group.
        device: Where the rank's collectives run (its device: NCCL needs a GPU).
    """

    def __init__(self, stages: Mapping[int, Sequence[nn.Parameter]], order: Sequence[int],
                 late: Collection[int], group: dist.ProcessGroup, device: torch.device) -> None:
        last = {id(p): s for s in order for p in stages[s]}  # a parameter two stages use: the later
        self._early: dict[int, list[nn.Parameter]] = {s: [] for s in order}
        self._late: list[nn.Parameter] = []
        seen: set[int] = set()
        for s in order:
            for p in stages[s]:
                if p.requires_grad and last[id(p)] == s and id(p) not in seen:
                    seen.add(id(p))
                    (self._late if id(p) in late else self._early[s]).append(p)
        self.group, self.device = group, device
        self.size = dist.get_world_size(group)
        self.begin()

    def begin(self) -> None:
        self._waiting = list(self._early)  # stages whose all-reduce has not started
        self._work: list[tuple[Any, torch.Tensor, list[nn.Parameter]]] = []

    def stage_done(self, stage: int) -> None:
        """Starts the all-reduce of ``stage``'s gradients."""
        self._waiting.remove(stage)
        self._start(self._early[stage])

    def average(self, loss: torch.Tensor) -> torch.Tensor:
        """Finishes the step's all-reduces; returns the mean loss over the replicas.

        Raises:
            RuntimeError: another replica's step failed (it called ``fail``);
                gradients are then left as this replica computed them.
        """
        self._start_rest()
        failed, total = self._exchange(False, loss)
        self._finish(copy=not failed)
        if failed:
            raise RuntimeError(
                f"the step failed on {failed} of the {self.size} data-parallel replicas "
                "(their ranks raised the cause); this replica's gradients were not averaged")
        return torch.tensor(total / self.size, dtype=loss.dtype, device=loss.device)

    def fail(self) -> None:
        """This replica's step failed: issues what it still owes the others
        (zeros), flagged as failed, so none waits for its gradients."""
        self._start_rest(zeros=True)
        self._exchange(True, None)
        self._finish(copy=False)

    def _start_rest(self, zeros: bool = False) -> None:
        for stage in self._waiting:
            self._start(self._early[stage], zeros)
        self._waiting = []
        self._start(self._late, zeros)

    def _start(self, params: list[nn.Parameter], zeros: bool = False) -> None:
        """Async all-reduces of ``params``' gradients, in buckets of about
        ``BUCKET_BYTES`` by dtype and device, each with one flag per
        parameter (1 where this replica has a gradient)."""
        groups: dict[tuple, list[list[nn.Parameter]]] = {}
        for p in params:
            buckets = groups.setdefault((p.dtype, p.device), [[]])
            if buckets[-1] and sum(q.numel() for q in buckets[-1]) * p.element_size() >= BUCKET_BYTES:
                buckets.append([])
            buckets[-1].append(p)
        for bucket in (b for buckets in groups.values() for b in buckets):
            has = [p.grad is not None and not zeros for p in bucket]
            flat = torch.cat([*(p.grad.reshape(-1).to(self.device) if h
                                else torch.zeros(p.numel(), dtype=p.dtype, device=self.device)
                                for p, h in zip(bucket, has)),
                              self._flags(has, bucket[0].dtype)])
            self._work.append((started(dist.all_reduce(flat, group=self.group, async_op=True)), flat, bucket))

    def _flags(self, has: list[bool], dtype: torch.dtype) -> torch.Tensor:
        """``has`` as a tensor on the device, without blocking the host: this
        runs mid-step on the rank's thread, and a copy from pageable memory
        would wait for its stream to drain."""
        flags = torch.tensor(has, dtype=dtype, pin_memory=self.device.type == "cuda")
        return flags.to(self.device, non_blocking=True)

    def _finish(self, copy: bool) -> None:
        work, self._work = self._work, []
        for handle, flat, bucket in work:
            finish(handle)
            if not copy:
                continue
            flags = flat[-len(bucket):].tolist()
            flat = flat[: -len(bucket)].div_(self.size)
            offset = 0
            for p, flag in zip(bucket, flags):
                part = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if flag == 0:
                    continue  # no replica has a gradient for it
                if p.grad is None:
                    p.grad = part.to(p.device).clone()
                else:
                    p.grad.copy_(part)

    def _exchange(self, failed: bool, loss: torch.Tensor | None) -> tuple[int, float]:
        """One small all-reduce: how many replicas failed, and the sum of their losses."""
        head = torch.tensor([float(failed), 0.0 if failed else float(loss.detach())],
                            dtype=torch.float64, device=self.device)
        all_reduce(head, group=self.group)
        failures, total = head.tolist()
        return int(failures), total


def check_weights(ties: Sequence, rank: int, held: Mapping[str, Any], group: dist.ProcessGroup,
                  dp_group: dist.ProcessGroup | None, device: torch.device,
                  problem: str | None = None) -> None:
    """Copies of one tensor on several ranks must hold the same values: a
    parameter tied across pipeline ranks (``ties``, compared over ``group``),
    and this rank's stages' entries ``held`` across data-parallel replicas
    (over ``dp_group``). Collective over both groups; every rank raises, or
    none. ``problem``: one this rank found already, raised first.

    Raises:
        ValueError: naming the tensor and the ranks, and how to fix it.
    """
    problems = [problem]
    if ties:
        named = [(t.name, t.param if rank in t.ranks else None) for t in ties]
        problems.append(differing(named, group, device, "pipeline ranks sharing a parameter"))
    if dp_group is not None:
        named = [(n, t) for n, t in held.items() if isinstance(t, torch.Tensor)]
        problems.append(differing(named, dp_group, device, "data-parallel replicas"))
    problem = next((p for p in problems if p), None)
    # What one rank found, every rank raises (group None: the world).
    for g in (group, dp_group) if dp_group is not None else (group,):
        everyone: list = [None] * dist.get_world_size(g)
        dist.all_gather_object(everyone, problem, group=g)
        problem = next((p for p in everyone if p), None)
    if problem is not None:
        raise ValueError(problem)


def differing(named: Sequence[tuple[str, torch.Tensor | None]], group: dist.ProcessGroup,
              device: torch.device, who: str) -> str | None:
    """Whether the ranks of ``group`` hold different values: a message naming
    the first tensor that differs and the ranks, or None. Collective over
    ``group``; every rank gets the same answer.

    ``named`` lists the same names on every rank, each with this rank's
    value, or None where the rank does not hold it. Values are compared by
    their float64 sum and sum of squares.
    """
    rows = torch.zeros(len(named), 3, dtype=torch.float64, device=device)
    with torch.no_grad():
        for i, (_, t) in enumerate(named):
            if t is not None:
                flat = t.detach().reshape(-1).to(device, torch.float64)
                rows[i] = torch.stack([flat.new_ones(()), flat.sum(), flat.square().sum()])
    everyone = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, rows, group=group)
    everyone = [r.cpu() for r in everyone]
    for i, (name, _) in enumerate(named):
        held = [(r, theirs[i, 1:]) for r, theirs in enumerate(everyone) if theirs[i, 0] > 0]
        for r, value in held[1:]:
            if not torch.equal(value, held[0][1]):
                return (
                    f"{who} start from different values of {name!r} (ranks {held[0][0]} and {r} of "
                    "their group): they would train apart. Start every rank from the same weights: "
                    "seed the same way before building the model (torch.manual_seed), load one "
                    "checkpoint on every rank (pipe.load_state_dict) before the first step, or "
                    "broadcast them: for t in model.state_dict().values(): "
                    "torch.distributed.broadcast(t, src=0)")
    return None
