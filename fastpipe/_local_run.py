"""Local mode's steps: one thread per pipeline rank, on lanes of the native ring.

Lanes ``0..ranks-1`` run each rank's action loop; lanes ``ranks..`` run its
sends (``overlap``) or, on the copy path, its copies. Values are handed over
through a native ``Mailbox``: as they are on CPUs, as copies into receive
slots on GPUs (``CopyTransport``, each rank's CUDA streams made once and
kept until ``close``).
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any

import torch

from fastpipe._args import Settings
from fastpipe._ring_lanes import RingLanes
from fastpipe.runtime.buffers import copy_slots
from fastpipe.runtime.checkpoint import stochastic
from fastpipe.runtime.executor import RankExecutor, Stage
from fastpipe.runtime.threads import autocast_state, switch_interval, with_caller_threads
from fastpipe.runtime.transport import CommLanes, CopyTransport, LocalTransport, Mailbox, ReceiveRings
from fastpipe.schedules import Schedule

__all__ = ["LocalRunner"]


class LocalRunner:
    """Runs every rank of a schedule as a thread of this process.

    Args:
        cfg: the Pipe's settings; ``cfg.switches.copies`` forces the copy
            path on CPUs, with host lanes (what the tests and the device
            check's rehearsal use), ``cfg.switches.switch_interval`` sets the
            GIL switch interval while several ranks run (``runtime/threads.py``).
        training, inference: the lowered schedules (their receive-ring sizes).

    Attributes:
        copies: transfers are copies on each rank's copy lane into receive
            slots (GPUs); on CPUs tensors are handed over as they are, and a
            pipeline mixing CPUs and GPUs uses blocking ``.to()`` copies.
        memory: rank -> peak saved-activation bytes of the last step.
        input_grads: the first stage's input gradients of the last step.
    """

    def __init__(self, cfg: Settings, training: Schedule, inference: Schedule) -> None:
        self.cfg = cfg
        self.ranks, self.devices, self.timeout, self.overlap, self.wire = (
            cfg.schedule.ranks, cfg.devices, cfg.timeout, cfg.overlap, cfg.wire)
        self._training, self._inference = training, inference  # lowered: receive-ring sizes
        copies = cfg.switches.copies
        self.copies = all(d.type == "cuda" for d in cfg.devices) if copies is None else copies
        self._lanes = RingLanes(cfg.timeout, cfg.overlap)
        self.device_lanes = self._lanes.device_lanes  # rank -> CudaLanes, made once (until close())
        self.recv_rings: ReceiveRings | None = None
        self.memory: dict[int, int] = {}
        self.input_grads: dict[int, list[torch.Tensor]] = {}

    def run(self, schedule: Schedule, stages: dict[int, dict[int, Stage]], inputs, targets, loss_fn,
            train: bool, recording: list | None) -> dict[int, Any]:
        """One step (or inference pass) of every rank; the last stage's rank's results.

        Raises the first failure: the mailbox's first (the failing rank's
        own exception), else a rank's.
        """
        self._ring_for()
        mailbox = Mailbox(schedule.ranks)
        # Ranks are threads sharing the CPU generator: stochastic stages take
        # turns drawing, each forward from its own seed (one draw of the
        # caller's generator per step, then (stage, microbatch)), so seeded
        # steps repeat and recomputation replays exactly.
        # They share the GIL too: backward leaves freeing the graph to the
        # executor (keep_graphs), so that it runs without the GIL, and only
        # native chains replace autograd (python_chains=False).
        shared = schedule.ranks > 1 and any(
            stochastic(st.module, training_only=True)
            for held in stages.values() for st in held.values())
        cfg = self.cfg
        rng_lock = threading.Lock() if cfg.checkpoint != "never" or shared else None
        rng_seed = int(torch.randint(0, 1 << 62, ()).item()) if shared else None
        last_rank = schedule.stage_to_rank[schedule.stages - 1]
        origin = time.perf_counter()
        amp = autocast_state()  # thread-local: read here, applied on each rank's lane

        transports = [self._transport(rank, mailbox) for rank in range(schedule.ranks)]
        lanes = [self._lanes_of(rank) for rank in range(schedule.ranks)] if self.copies else []
        for rank_lanes in lanes:
            rank_lanes.enter_from_caller()

        def run_rank(rank: int):
            executor = RankExecutor(rank, schedule, stages[rank], transports[rank], cfg.checkpoint,
                                    rng_lock, keep_graphs=True, fused_wgrad=cfg.fused_wgrad,
                                    autocast=amp, python_chains=cfg.switches.chains == "python",
                                    rng_seed=rng_seed, gather_w=cfg.switches.gather_w,
                                    known_losses=cfg.switches.known_losses)
            if recording is not None:
                executor.records, executor.origin = [], origin
            try:
                with lanes[rank].compute() if lanes else nullcontext():
                    return executor.run(inputs, targets, loss_fn, train)  # fails the mailbox on error
            finally:
                if train:
                    self.memory[rank] = executor.peak_activation_bytes
                    if 0 in stages[rank]:
                        self.input_grads = executor.input_grads
                if executor.records is not None:
                    recording.extend(executor.records)  # list.extend is atomic

        with switch_interval(cfg.switches.switch_interval if schedule.ranks > 1 else None):
            events = [self.ring.submit(r, with_caller_threads(lambda r=r: run_rank(r)))
                      for r in range(schedule.ranks)]
            outcomes = self._outcomes(events, mailbox, lanes)
        return outcomes[last_rank]

    def _outcomes(self, events, mailbox: Mailbox, lanes) -> list:
        """Every rank's result, once all stopped; raises the first failure
        (the mailbox's, the failing rank's own exception, else a rank's)."""
        try:
            outcomes = [_outcome(ev) for ev in events]
        except KeyboardInterrupt as exc:
            mailbox.fail(-1, exc)  # unblock the workers, then let them finish
            for ev in events:
                _outcome(ev)
            for rank_lanes in lanes:  # what the ranks queued comes before the caller's next work
                rank_lanes.exit_to_caller()
            self._drop_rings(lanes)
            raise
        for rank_lanes in lanes:
            rank_lanes.exit_to_caller()
        failed = [v for v in outcomes if isinstance(v, BaseException)]
        if mailbox.first_failure is not None or failed:
            self._drop_rings(lanes)
        if mailbox.first_failure is not None:
            raise mailbox.first_failure[1]
        for value in failed:
            raise value
        return outcomes

    def close(self) -> None:
        """Stops the ring's lanes and gives the CUDA streams back to the
        process's pool (``runtime/streams.py``); a later step makes both afresh."""
        self._lanes.close()

    @property
    def ring(self):
        return self._lanes.ring

    def _ring_for(self):
        return self._lanes.ring_for(2 * self.ranks if self.overlap or self.copies else self.ranks)

    def _transport(self, rank: int, mailbox: Mailbox):
        if self.copies:
            return CopyTransport(mailbox, rank, self.devices, self.timeout, self._lanes_of(rank),
                                 self._rings(), self.wire)
        lanes = CommLanes(self.ring, self.ranks + rank) if self.overlap else None
        return LocalTransport(mailbox, rank, self.devices, self.timeout, lanes, self.wire)

    def _lanes_of(self, rank: int):
        """A rank's device lanes: its CUDA streams (made once), or host lanes
        on the current ring (lane ``ranks + rank`` runs its copies)."""
        return self._lanes.of(rank, self.devices[rank], self.ranks + rank)

    def _drop_rings(self, lanes) -> None:
        """After a failed step: slots of messages nobody took are still held,
        so the receive rings start afresh (once every lane is idle)."""
        if self.recv_rings is None:
            return
        for rank_lanes in lanes:
            rank_lanes.synchronize(rank_lanes.record())
        self.recv_rings = None

    def set_schedules(self, training, inference) -> None:
        """Other lowered schedules (another order of the same placement), from
        the next step on. Receive rings not made yet are sized for these; the
        ones made keep their slots and grow if this order needs more."""
        self._training, self._inference = training, inference
        if self.recv_rings is not None:
            for stream, n in copy_slots(training.actions).items():
                self.recv_rings.sizes[stream] = max(n, self.recv_rings.sizes.get(stream, 0))

    def _rings(self) -> ReceiveRings:
        if self.recv_rings is None:
            # The worst case over every timing, of training and of inference.
            sizes = copy_slots(self._training.actions)
            for stream, n in copy_slots(self._inference.actions).items():
                sizes[stream] = max(n, sizes.get(stream, 0))
            self.recv_rings = ReceiveRings(sizes, self.timeout)
        return self.recv_rings


def _outcome(event) -> Any:
    """The rank's result, or the exception it ended with (reported once all stopped)."""
    try:
        return event.wait()
    except Exception as exc:  # noqa: BLE001
        return exc
