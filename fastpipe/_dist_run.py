"""Distributed mode's steps: this process's pipeline rank, its messages and the loss broadcast.

Messages travel through shared-memory rings when every rank is on this host
(``runtime/shm.py``), else through torch.distributed P2P on two groups of
their own, one per direction (``transport.flow_groups``); on NCCL under its
rules (exact sizes, matched by order), every pair connected when the Pipe is
built (``transport.connect_pairs``). The loss is computed on the last
stage's rank and broadcast to the others without that rank waiting for it;
through the shared-memory rings where that rank has one to every other
rank (a gloo broadcast of it cost its receivers ~0.3 ms a step). A rank that
fails after its last message of the step (in a W) still takes its part in
the broadcast, so no rank is left waiting for a loss (``_loss_after_failure``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastpipe._args import Settings, raise_first
from fastpipe._ring_lanes import RingLanes
from fastpipe.runtime.executor import RankExecutor, Stage
from fastpipe.runtime.threads import autocast_state
from fastpipe.runtime.transport import CommLanes, DistTransport, connect_pairs, flow_groups, late_groups
from fastpipe.runtime.transport.base import PeerError
from fastpipe.runtime.transport.groups import broadcast, finish, started
from fastpipe.schedules import Schedule

__all__ = ["DistRunner", "ranks_agree"]

_LOSS_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# What the last stage's rank sends its peers at a step's end, as float64 words:
# [the mean loss, its dtype's index in _LOSS_DTYPES or _FAILED, then (failed)
# the rank's error, utf-8, in the bytes of the remaining words].
_LOSS_WORDS = 34
_FAILED = -1.0


class DistRunner:
    """Runs this process's rank of a pipeline over ``group``.

    Collective over the group's ranks when made (shared-memory set-up,
    flow groups, NCCL pair connections): every rank makes it in the same
    order.

    Attributes:
        shm_link: the shared-memory rings ``(link, writers, readers)``, or None.
        transport: the DistTransport or ShmTransport, made at the first step
            (kept after ``close``: both ends learnt the same sizes).
        broken: the failure that ended a step; the group may still hold its
            messages, so no later step runs.
        memory: rank -> peak saved-activation bytes of the last step.
        input_grads: the first stage's input gradients of the last step.
    """

    def __init__(self, cfg: Settings) -> None:
        self.cfg = cfg
        self.group, self.rank, self.schedule, self.devices = cfg.group, cfg.rank, cfg.schedule, cfg.devices
        self.timeout, self.overlap, self.wire, self.exact = cfg.timeout, cfg.overlap, cfg.wire, cfg.exact
        self.nccl = cfg.nccl
        self.shm_link = self._connect_shm(cfg.shm)
        # Messages up and down the ranks on separate groups (see flow_groups).
        split = self.shm_link is None and dist.get_backend(cfg.group) in ("gloo", "nccl")
        self.p2p_groups = flow_groups(cfg.group) if split else {}
        self.late_groups = late_groups(cfg.group) if cfg.exact else {}
        if cfg.exact:  # NCCL's pair communicators, each made before any step
            connect_pairs([*(self.p2p_groups.values() or [cfg.group]), *self.late_groups.values()],
                          cfg.group, cfg.schedule.stage_to_rank, cfg.rank, cfg.devices[cfg.rank])
        self.transport = None
        self._lanes = RingLanes(cfg.timeout, cfg.overlap)
        self.broken: BaseException | None = None
        self.memory: dict[int, int] = {}
        self.input_grads: dict[int, list[torch.Tensor]] = {}
        # The last stage's rank: the loss broadcast of the last step, still
        # in flight (Work, tensor), waited for before the next collective.
        self._loss_broadcast: tuple | None = None
        # The last step failed here after its last message (``_loss_after_failure``).
        self.failed_late = False
        self._loss_by_rings: bool | None = None  # ``_loss_rings``, decided at the first step

    def run(self, schedule: Schedule, stages: dict[int, Stage], inputs, targets, loss_fn,
            train: bool, refuse: BaseException | None, recording: list | None,
            grads_done: Callable[[int], None] | None) -> dict[int, Any]:
        """This rank's actions of one step (or inference pass); its results."""
        try:
            self.finish_loss_broadcast()
        except BaseException as exc:  # the last step's end failed: the group is out of step
            self.broken = exc
            raise
        self.failed_late = False
        transport = self.transport_for(self.rank)
        transport.all_actions = schedule.actions  # exact messages follow the senders' order
        cfg = self.cfg
        executor = RankExecutor(self.rank, schedule, stages, transport, cfg.checkpoint,
                                fused_wgrad=cfg.fused_wgrad, autocast=autocast_state(),
                                gather_w=cfg.switches.gather_w,
                                known_losses=cfg.switches.known_losses, grads_done=grads_done)
        if recording is not None:
            finish(dist.barrier(group=self.group, async_op=True))  # every rank's clock starts together
            executor.records = recording
        # NCCL: the rank's work runs on its own compute stream; isend is
        # issued there after the data's kernels, and Work.wait() there
        # orders the consumer after the receive (see DistTransport).
        lanes = self._lanes_of(self.rank) if self.nccl else None
        try:
            if lanes is None:
                return executor.run(inputs, targets, loss_fn, train, refuse)
            lanes.enter_from_caller()
            try:
                with lanes.compute():
                    return executor.run(inputs, targets, loss_fn, train, refuse)
            finally:
                lanes.exit_to_caller()
        except BaseException as exc:
            self.broken = exc
            self.failed_late = train and executor.unsent == [] and isinstance(exc, Exception) \
                and not isinstance(exc, PeerError)
            if self.failed_late:
                self._loss_after_failure(exc)
            raise
        finally:
            if train:
                self.memory[self.rank] = executor.peak_activation_bytes
                self.input_grads = executor.input_grads

    def _loss_after_failure(self, exc: BaseException) -> None:
        """This rank failed after it sent every message it owed (in its last
        W, say): the others finish their steps and wait for the loss, so it
        takes part in the broadcast all the same, as its sender with the
        failure and its reason (the others raise a PeerError naming it) or as
        a receiver; for at most the Pipe's timeout, in case another rank
        failed too. Through the rings nothing is needed: their abort reaches
        the ranks waiting on them."""
        owner = self._loss_owner()
        if self._loss_rings(owner) is not None:
            return
        packed = torch.zeros(_LOSS_WORDS, dtype=torch.float64)
        if self.rank == owner:
            packed[1] = _FAILED
            reason = f"{type(exc).__name__}: {exc}".encode()[: (_LOSS_WORDS - 2) * 8]
            packed[2:].view(torch.uint8)[: len(reason)] = torch.frombuffer(bytearray(reason),
                                                                            dtype=torch.uint8)
        src = self._loss_src(owner)
        try:
            finish(dist.broadcast(packed.to(self.devices[self.rank]), src=src, group=self.group,
                                  async_op=True), self.timeout)
        except Exception:  # noqa: BLE001 - the step's own error is what the caller gets
            pass

    def joins_after_failure(self) -> bool:
        """Whether this rank, its step failed, takes part in the collectives
        after the loss (the tied-parameter sum) all the same: it failed after
        its last message and is not the loss's rank, so the others got their
        loss and are in them (had the loss's rank failed, they raised there)."""
        return self.failed_late and self.rank != self._loss_owner()

    def _loss_owner(self) -> int:
        """The rank of the last stage, which computes the loss."""
        return self.schedule.stage_to_rank[self.schedule.stages - 1]

    def _loss_src(self, owner: int) -> int:
        """``owner``'s rank in the default group, as torch's collectives take it."""
        return dist.get_global_rank(self.group, owner) if self.group is not None else owner

    def _loss_rings(self, owner: int):
        """The ShmTransport that carries the loss, or None: shared memory is
        on and the last stage's rank has a ring to every other rank (it
        holds a stage next to each of theirs: two ranks, say). The placement
        is the Pipe's for its life, so this is decided once."""
        if self._loss_by_rings is None:
            from fastpipe.runtime.shm import neighbours

            ranks = set(range(self.schedule.ranks)) - {owner}
            self._loss_by_rings = (self.shm_link is not None
                                   and neighbours(self.schedule.stage_to_rank, owner) == ranks)
        return self.transport if self._loss_by_rings else None

    def mean_loss(self, results: dict[int, torch.Tensor], chunks: int) -> torch.Tensor:
        """The mean of the microbatches' losses, on every rank: computed on the
        last stage's rank and sent (with its dtype) to the others, through the
        rings after the step's messages (``_loss_rings``) or a broadcast.

        Raises:
            PeerError: the last stage's rank failed after its last message.
        """
        owner = self._loss_owner()
        rings = self._loss_rings(owner)
        if self.rank != owner:
            if rings is not None:
                return self._received_loss(rings.take_value(owner, torch.empty(_LOSS_WORDS,
                                                                               dtype=torch.float64)),
                                           owner)
            packed = torch.zeros(_LOSS_WORDS, dtype=torch.float64, device=self.devices[self.rank])
            src = self._loss_src(owner)
            broadcast(packed, src, self.group)
            return self._received_loss(packed, owner)
        loss = torch.stack([results[mb] for mb in range(chunks)]).mean()
        code = _LOSS_DTYPES.index(loss.dtype) if loss.dtype in _LOSS_DTYPES else 0
        # The loss's dtype is only known where it was computed: it goes along.
        packed = torch.zeros(_LOSS_WORDS, dtype=torch.float64)
        packed[0], packed[1] = loss.detach().double().cpu(), float(code)
        if rings is not None:
            for dst in range(self.schedule.ranks):
                if dst != owner:
                    rings.send_value(packed, dst)
            return packed[0].to(_LOSS_DTYPES[code])
        packed = packed.to(self.devices[self.rank])
        src = self._loss_src(owner)
        # The other ranks need the value; this one has it. Not waiting here
        # takes the broadcast off this rank's step: its peers reach it only
        # after their last backward.
        self.finish_loss_broadcast()
        self._loss_broadcast = (started(dist.broadcast(packed, src=src, group=self.group,
                                                       async_op=True)), packed)
        return packed[0].to(_LOSS_DTYPES[code])  # what the others get (read only)

    @staticmethod
    def _received_loss(packed: torch.Tensor, owner: int) -> torch.Tensor:
        head = packed[:2].cpu()
        code = head[1].item()
        if code == _FAILED:
            reason = bytes(packed[2:].cpu().view(torch.uint8).tolist()).rstrip(b"\0")
            raise PeerError(f"pipeline rank {owner} failed after its last message of the step: "
                            f"{reason.decode('utf-8', 'replace')}")
        return packed[0].to(_LOSS_DTYPES[int(code)])

    def set_schedules(self, training, inference) -> None:
        """Another order of the same placement, from the next step on: the
        transport makes its receive rings for each action list it begins."""

    def finish_loss_broadcast(self) -> None:
        """Waits for the last step's loss broadcast, if it is still in flight."""
        if self._loss_broadcast is not None:
            work, _ = self._loss_broadcast
            self._loss_broadcast = None
            finish(work)

    def close(self) -> None:
        """Waits for the loss broadcast; stops the ring's lanes and gives the
        CUDA streams back to the process's pool. A later step makes both afresh."""
        try:
            self.finish_loss_broadcast()
        finally:
            self._lanes.close()

    def transport_for(self, rank: int):
        """This rank's transport (made at the first step, kept after)."""
        if self.shm_link is not None:
            if self.transport is None:
                from fastpipe.runtime.shm import ShmTransport

                link, writers, readers = self.shm_link
                self.transport = ShmTransport(link, writers, readers, self.devices[rank],
                                              self.schedule.stages, self.timeout, self.wire)
            return self.transport
        lanes = CommLanes(self._ring_for(), 0, 1, 2, 3) if self.overlap else None
        if self.transport is not None:  # kept: both ends learnt the same sizes
            self.transport.lanes = lanes  # the ring is new after close()
        else:
            self.transport = DistTransport(
                self.group, self.devices[rank], self.schedule.stages, self.timeout, lanes,
                self.wire, stage_to_rank=tuple(self.schedule.stage_to_rank),
                groups=self.p2p_groups, exact=self.exact, late=self.late_groups, rank=rank,
                # NCCL sends GPU memory; gloo's P2P takes host tensors.
                buffers=self.devices[rank] if self.nccl else torch.device("cpu"),
            )
        return self.transport

    def _ring_for(self):
        return self._lanes.ring_for(4 if self.overlap else 1)

    def _lanes_of(self, rank: int):
        """The rank's CUDA streams (made once until close)."""
        return self._lanes.of(rank, self.devices[rank], self.schedule.ranks + rank)

    def _connect_shm(self, shm: bool | None):
        """The shared-memory rings of a same-host CPU pipeline (``runtime/shm.py``), or None."""
        if shm is False:
            return None
        if self.nccl:
            if shm:
                raise ValueError("Pipe(shm=True) needs a gloo group with CPU devices; this group "
                                 "is NCCL, which has its own shared-memory transport")
            return None
        from fastpipe.runtime.shm import connect, neighbours

        why_not = None
        if dist.get_backend(self.group) != "gloo":
            why_not = f"the group's backend is {dist.get_backend(self.group)}, not gloo"
        elif self.devices[self.rank].type != "cpu":
            why_not = f"its device is {self.devices[self.rank]}, not a CPU"
        elif self.exact:
            why_not = "exact messages are on (FASTPIPE_EXACT_MESSAGES=1)"
        elif self.overlap:
            why_not = "overlap=True runs transfers on lanes; shared memory runs them inline"
        peers = neighbours(self.schedule.stage_to_rank, self.rank)
        return connect(self.group, self.rank, self.schedule.ranks, peers, why_not, required=shm is True,
                       size=self.cfg.switches.shm_bytes)


def ranks_agree(settings: dict, problem: str | None, groups: Sequence[tuple[Any, str]]) -> None:
    """One small collective per group: every rank must have built the same
    pipeline (``settings``: name -> value) and found no set-up ``problem``.

    Raises (on every rank of the group):
        ValueError: the first rank's problem, or the first setting that
            differs with each rank's value.
    """
    for group, who in groups:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (settings, problem), group=group)
        raise_first([theirs for _, theirs in everyone])
        for name in settings:
            values = [theirs[name] for theirs, _ in everyone]
            if any(v != values[0] for v in values):
                listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
                raise ValueError(f"{who} disagree on {name} ({listed}); every rank must "
                                 "build the Pipe with the same arguments")
