"""Data parallelism across pipelines: replicas of one pipeline on a ``("dp", "pp")`` mesh.

Each data-parallel replica runs the whole pipeline over its own shard of
the batch; rank ``r`` of every replica holds the same stages. After a step
the replicas average what they computed over the ``dp`` group, rank by
rank: the gradients of the parameters that rank holds (so each replica ends
the step with the gradient of the mean loss over the global batch, as the
unsplit model over all shards would) and the loss. Gradients go in buckets
of about ``BUCKET_BYTES`` per dtype and device, all started before any is
waited for (as DDP buckets them).

Before the replicas' first step their weights are compared (``differing``):
replicas that start apart stay apart, silently, since each applies the same
averaged update to different weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 25 * 2**20


class GradAverage:
    """Averages gradients and the loss over the data-parallel group after each step.

    Every rank of the ``dp`` group calls ``average`` (or ``fail``) once per
    step, in the same order. A parameter that no replica produced a
    gradient for keeps ``.grad`` as it was; one that some replicas did not
    touch counts zeros from them.

    Args:
        params: The parameters this rank's stages hold, each once, in the
            same order on every replica.
        group: The ``dp`` process group.
        device: Where the rank's collectives run (its device: NCCL needs a GPU).
    """

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup,
                 device: torch.device) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.device = device
        self.size = dist.get_world_size(group)

    def average(self, loss: torch.Tensor) -> torch.Tensor:
        """Averages this step's gradients over the replicas; returns the mean loss.

        Raises:
            RuntimeError: another replica's step failed (it called ``fail``);
                gradients are then left as this replica computed them.
        """
        produced = self._exchange(failed=False, loss=loss)
        work = []
        for bucket in self._buckets(produced):
            flat = torch.cat([_grad_or_zeros(p, self.device).reshape(-1) for p in bucket])
            work.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket))
        for handle, flat, bucket in work:
            handle.wait()
            flat.div_(self.size)
            offset = 0
            for p in bucket:
                part = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = part.to(p.device).clone()
                else:
                    p.grad.copy_(part)
        return self._loss

    def fail(self) -> None:
        """This replica's step failed: tells the others, so none waits for its gradients."""
        self._exchange(failed=True, loss=None)

    def _exchange(self, failed: bool, loss: torch.Tensor | None) -> list[bool]:
        """One small all-reduce: which parameters have a gradient anywhere,
        whether any replica failed, and the sum of the losses."""
        head = torch.zeros(len(self.params) + 2, dtype=torch.float64, device=self.device)
        if not failed:
            head[: len(self.params)] = torch.tensor([p.grad is not None for p in self.params],
                                                    dtype=torch.float64)
            head[-1] = loss.detach().double()
        head[-2] = float(failed)
        dist.all_reduce(head, group=self.group)
        values = head.tolist()
        if failed:
            return []
        if values[-2] > 0:
            raise RuntimeError(
                f"the step failed on {int(values[-2])} of the {self.size} data-parallel replicas "
                "(their ranks raised the cause); this replica's gradients were not averaged")
        self._loss = torch.tensor(values[-1] / self.size, dtype=loss.dtype, device=loss.device)
        return [v > 0 for v in values[: len(self.params)]]

    def _buckets(self, produced: list[bool]) -> list[list[nn.Parameter]]:
        """Parameters some replica has a gradient for, by dtype and device, in
        buckets of about ``BUCKET_BYTES`` (the same on every replica)."""
        groups: dict[tuple, list[list[nn.Parameter]]] = {}
        for p, has in zip(self.params, produced):
            if not has:
                continue
            buckets = groups.setdefault((p.dtype, p.device), [[]])
            if buckets[-1] and sum(q.numel() for q in buckets[-1]) * p.element_size() >= BUCKET_BYTES:
                buckets.append([])
            buckets[-1].append(p)
        return [b for buckets in groups.values() for b in buckets]


def _grad_or_zeros(p: nn.Parameter, device: torch.device) -> torch.Tensor:
    grad = p.grad if p.grad is not None else torch.zeros_like(p)
    return grad.to(device)


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
