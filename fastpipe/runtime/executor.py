"""One executor loop for every schedule: run a rank's lowered action list.

The schedule says *what* to run; this module knows *how*: each action kind
maps to one small verb (``_forward``, ``_backward``, ``_send_f`` ...). A
rank's state lives in dicts keyed by ``(stage, microbatch)`` and every entry
is dropped as soon as the last action that needs it has run, so saved
activations follow the schedule's in-flight count. Received buffers are
handed back to the transport's buffer ring after the last compute action of
their (stage, microbatch), since the stage input is a view into them.

Data flow of one microbatch across a rank boundary (stage s on this rank):

    RECV_F ──► F(s) ──► SEND_F          forward: activations to stage s+1
    RECV_B ──► B/I(s) ──► SEND_B        backward: input gradients to s-1
                    └──► W(s)           zero-bubble: weight gradients later

Transfers between two stages of the same rank (V placements, interleaving
with one rank) need no communication: the value goes into ``_local``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import threading
import time
from contextlib import nullcontext

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.profiler import record_function

from fastpipe._microbatch import Value, flatten, needs_grad, unflatten
from fastpipe.runtime import deferred
from fastpipe.runtime._backward import backward_full
from fastpipe.runtime.buffers import last_use
from fastpipe.runtime.chain import Chain
from fastpipe.runtime.chain import enabled as chains_enabled
from fastpipe.runtime.chain import gathering as chain_gathering
from fastpipe.runtime.losses import known_loss
from fastpipe.runtime.checkpoint import (NO_RANDOM, RngState, checkpointed, forgetful, guarded,
                                         recompute, seeded, stage_seed, stochastic)
from fastpipe.runtime.memory import SavedBytes
from fastpipe.runtime.threads import Autocast, autocast
from fastpipe.runtime.transport import CallMismatch, Transport
from fastpipe.schedules import Action, Kind, Schedule, TimelineRecord

LossFn = Callable[[Any, Any], torch.Tensor]
_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
_WAIT_KIND = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B, Kind.I: Kind.RECV_B}


@dataclass
class Stage:
    """One contiguous slice of the user's layers, placed on a device."""

    index: int
    module: nn.Sequential
    device: torch.device
    params: list[torch.Tensor] = field(init=False)

    stochastic: bool = field(init=False)  # holds dropout-like layers
    # Saved-activation bytes of a forward, by (kind, input shapes and dtypes):
    # counted with hooks the first time, then looked up (hooks cost ~5 %).
    saved_bytes: dict = field(default_factory=dict, init=False)
    # W work of a split schedule waiting to be gathered (``deferred.WeightQueue``).
    weights: deferred.WeightQueue = field(default_factory=deferred.WeightQueue, init=False)
    # The layers as a Chain (``fastpipe.runtime.chain``) when they all are
    # ones it knows: forward and backward then run without a graph.
    chain: Chain | None = field(init=False)

    def __post_init__(self) -> None:
        self.refresh()
        self.stochastic = stochastic(self.module)
        self.chain = Chain.of(self.module) if chains_enabled() else None

    def refresh(self) -> None:
        """Re-reads the parameters, after a module's entries changed (local
        mode swaps replicas of parameters tied across ranks in for a call)."""
        self.params = [p for p in self.module.parameters() if p.requires_grad]


@dataclass
class _Saved:
    """What backward needs from one F: graph roots and the stage's input leaves."""

    roots: list[torch.Tensor | GradientEdge]  # the loss tensor, or edges of the outputs
    leaves: list[torch.Tensor]
    grads: list[torch.Tensor | None] | None = None  # set once received
    rng: RngState | Any = None  # checkpointed (RngState or NO_RANDOM): roots come from a recomputation
    spec: Any = False  # structure of the stage input (see _microbatch.Spec)
    # A chain's forward: what its backward reads (roots are then the loss
    # alone, on the last stage, whose output ``out`` is a leaf).
    chain: list[torch.Tensor] | None = None
    out: torch.Tensor | None = None
    # Split schedules: the weight work the layers' backward leaves for W.
    pending: deferred.Pending | None = None


def last_backward(actions: Sequence[Action]) -> dict[int, int]:
    """Index of each stage's last B, I or W in a rank's list."""
    return {a.stage: i for i, a in enumerate(actions) if a.kind in (Kind.B, Kind.I, Kind.W)}


def _range(a: Action) -> record_function:
    return record_function(f"fastpipe.{a.kind.name} stage={a.stage} mb={a.microbatch}")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class RankExecutor:
    """Runs the actions of one pipeline rank for one step.

    Args:
        rank: this rank's index in the schedule.
        schedule: the lowered schedule (compute and communication actions).
        stages: the stages this rank holds, by stage index.
        transport: this rank's transport (``fastpipe.runtime.transport.Transport``).
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"`` (see
            ``fastpipe.runtime.checkpoint``).
        rng_lock: local mode: a lock shared by the ranks' threads that
            stochastic stages hold while they draw random numbers, so a
            checkpointed forward replays exactly.
        keep_graphs: backward leaves the saved tensors to go with the graph
            when the executor drops it, instead of freeing them as it runs:
            what ranks on threads of one interpreter want, since a backward
            then needs no GIL (see ``fastpipe.runtime._backward``).
        fused_wgrad: B too leaves the weight gradients of layers with a
            rule to deferred W (``fastpipe.runtime.deferred``), run at once
            or gathered, each Linear's with one ``addmm_`` into ``.grad``.
        autocast: the caller's autocast regions and cache flag
            (``threads.autocast_state()``, read on the caller's thread):
            forwards, the loss and recomputation run under them, B, I and W
            with them off.
        python_chains: stages whose ``Chain`` is not native (``fastpipe._chain``
            not built) run through it too, their ops issued from Python (see
            ``fastpipe.runtime.chain``); native chains always run. Ranks on
            threads of one interpreter want False: each op from Python hands
            the GIL over to the other ranks' threads, where autograd's engine
            runs a whole backward without it (local 1F1B on the narrow
            benchmark model: 37.7 ms a step with them against 20.4 ms without).
        rng_seed: local mode with stochastic stages: a number drawn once for
            the step; each stochastic forward then runs under the lock with
            its generator seeded from it and its (stage, microbatch)
            (``checkpoint.seeded``), so ``torch.manual_seed`` makes a step
            repeat whatever order the ranks' threads ran in.
        grads_done: training: called with a stage's index once its step's
            gradients are all in ``.grad`` (after its last B or W, its
            gathered W work run at once), while the rank goes on with its
            other stages: data parallelism starts that stage's all-reduce.
    """

    def __init__(
        self,
        rank: int,
        schedule: Schedule,
        stages: dict[int, Stage],
        transport: Transport,
        checkpoint: str = "never",
        rng_lock: threading.Lock | None = None,
        keep_graphs: bool = False,
        fused_wgrad: bool = False,
        autocast: tuple[Autocast, bool] = ((), True),
        python_chains: bool = True,
        rng_seed: int | None = None,
        grads_done: Callable[[int], None] | None = None,
    ) -> None:
        self.rank = rank
        self.grads_done = grads_done
        self.python_chains = python_chains
        self.gather_w = chain_gathering()  # W gathered over microbatches, fused into .grad
        self._amp, self._amp_cache = autocast
        self.keep_graphs, self.fused_wgrad = keep_graphs, fused_wgrad
        self.checkpoint, self.rng_lock = checkpoint, rng_lock
        self.rng_seed = rng_seed
        self.schedule = schedule
        self.stages = stages
        self.transport = transport
        self.actions: Sequence[Action] = schedule.actions[rank]
        # When a list, run() appends TimelineRecords (seconds since the step began).
        self.records: list[TimelineRecord] | None = None
        self.origin: float | None = None  # perf_counter() of the step's start
        self._wait_end: float | None = None
        # Functions, not bound methods: a dict of this executor's bound
        # methods would be a reference cycle, and everything the step left
        # here (its inputs, targets, results: on a GPU, device memory) would
        # live on after the step until the garbage collector ran.
        self._verbs = {
            Kind.F: RankExecutor._forward, Kind.B: RankExecutor._backward,
            Kind.I: RankExecutor._backward_input, Kind.W: RankExecutor._backward_weight,
            Kind.SEND_F: RankExecutor._send_f, Kind.RECV_F: RankExecutor._recv,
            Kind.SEND_B: RankExecutor._send_b, Kind.RECV_B: RankExecutor._recv,
        }
        # After the action at index i, hand back the buffers of this (stage, mb).
        self._release_at = {i: key for key, i in last_use(self.actions).items()}
        # After the action at index i, this stage's last backward of the step has run.
        self._grads_done_at = {i: stage for stage, i in last_backward(self.actions).items()}
        # (stage, mb) of each B whose very next action sends its input gradient:
        # a chain stage sends it between I and W (``_backward``).
        self._send_after_i = {
            (a.stage, a.microbatch) for a, b in zip(self.actions, self.actions[1:])
            if a.kind is Kind.B and b.kind is Kind.SEND_B
            and (b.stage, b.microbatch) == (a.stage, a.microbatch)
        }
        # Saved-activation bytes of each (stage, mb) alive, and the step's peak.
        self._saved_bytes = SavedBytes(p for st in stages.values() for p in st.module.parameters())
        self._activations: dict[tuple[int, int], int] = {}
        self.live_activation_bytes = 0
        self.peak_activation_bytes = 0

    # --- the loop -------------------------------------------------------------

    def run(
        self,
        inputs: Sequence[Value] | None,
        targets: Sequence[Any] | None,
        loss_fn: LossFn | None,
        train: bool,
        refuse: BaseException | None = None,
    ) -> dict[int, Any]:
        """Runs every action of this rank in order.

        ``refuse``: this rank's inputs were refused; the step fails with it
        at once, through the transport's failure path, so peers learn why
        instead of waiting out their timeout.

        Returns:
            On the rank of the last stage: ``{microbatch: loss}`` when training,
            ``{microbatch: output}`` otherwise. Elsewhere an empty dict.
        """
        self._inputs, self._targets, self._loss_fn, self._train = inputs, targets, loss_fn, train
        self._pending: dict[tuple[str, int, int], Any] = {}
        self._local: dict[tuple[str, int, int], tuple[list[torch.Tensor], bool]] = {}
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._outbox: dict[tuple[str, int, int], tuple[list[torch.Tensor], bool]] = {}
        self._weights: dict[tuple[int, int], deferred.Pending] = {}
        self._results: dict[int, Any] = {}
        # Gradients of the first stage's inputs, by microbatch: the caller
        # carries them into its own tensors (Pipe._backward_into_inputs).
        self.input_grads: dict[int, list[torch.Tensor]] = {}
        self._held: dict[tuple[int, int], list] = {}  # received buffers in use
        self._sent: set[tuple[str, int, int]] = set()
        # The stages that run as chains this step (see fastpipe.runtime.chain).
        self._chains = set() if self._amp else {
            i for i, st in self.stages.items()
            if st.chain is not None and (st.chain.native or self.python_chains) and st.chain.ready()
        }
        # A known loss after a chain stage is computed with its gradient, no graph.
        last = self.schedule.stages - 1
        self._known_loss = known_loss(loss_fn) if train and last in self._chains else None
        # A split schedule (I and W actions), or fused_wgrad: the other
        # stages' layers defer their weight gradients to W, or to the end of
        # B (``fastpipe.runtime.deferred``).
        self._split = train and (self.fused_wgrad or any(a.kind is Kind.W for a in self.actions))
        installed = [deferred.install(st.module) for i, st in self.stages.items()
                     if i not in self._chains] if self._split else []
        self.transport.begin(self.actions)
        self._ahead = self.transport.posts_ahead
        if self._ahead:
            # Hand every receive of the step to the transport now: each is
            # posted as soon as its buffer ring has a slot, so the sender's
            # message lands when it is sent instead of waiting for the consumer.
            for action in self.actions:
                if action.kind in (Kind.RECV_F, Kind.RECV_B):
                    self._post(action)
        grad_mode = torch.enable_grad() if train else torch.no_grad()
        try:
            # Autocast off but where _forward and _recompute turn it on.
            if refuse is not None:
                raise refuse
            with grad_mode, autocast(self._amp, self._amp_cache, enabled=False):
                self._loop()
        except BaseException as exc:
            unsent = self._unsent()
            if isinstance(exc, CallMismatch):
                # The peer runs the other call's list: it may wait for messages
                # this one never sends (gradients, when this rank is in pipe(x)).
                unsent += self._all_backward_sends(unsent)
            self.transport.fail(exc, unsent)
            raise
        finally:
            for i in self._chains:  # no reference to the parameters outlives the step
                self.stages[i].chain.unbind()
            for layers in installed:
                deferred.uninstall(layers)
            if self._weights or any(st.weights.waiting for st in self.stages.values()):
                for st in self.stages.values():  # a failed step: W's work is dropped
                    st.weights.clear()
        leftovers = [
            name for name in ("_saved", "_weights", "_outbox", "_pending", "_local", "_held")
            if getattr(self, name)
        ]
        if leftovers:
            raise AssertionError(f"rank {self.rank}: the schedule left {leftovers} non-empty")
        return self._results

    def _loop(self) -> None:
        verbs, release_at = self._verbs, self._release_at
        origin = None
        if self.records is not None:
            origin = self.origin if self.origin is not None else time.perf_counter()
        # Under a torch profiler every action is a range of its own
        # ("fastpipe.F stage=1 mb=3"), so the user's trace shows the schedule;
        # without one, the loop has nothing extra to do.
        profiling = torch.autograd.profiler._is_profiler_enabled
        done_at = self._grads_done_at if self.grads_done is not None and self._train else {}
        if origin is None and not profiling:
            for i, action in enumerate(self.actions):
                verbs[action.kind](self, action)
                if i in release_at:
                    self._release(release_at[i])
                if i in done_at:
                    self._stage_grads_done(done_at[i], origin)
        else:
            for i, action in enumerate(self.actions):
                with _range(action) if profiling else nullcontext():
                    if origin is None:
                        verbs[action.kind](self, action)
                    else:
                        self._timed(action, origin)
                if i in release_at:
                    self._release(release_at[i])
                if i in done_at:
                    self._stage_grads_done(done_at[i], origin)
        with record_function("fastpipe.W gathered") if profiling else nullcontext():
            self._flush_deferred(origin)
        self.transport.finish()

    def _flush_deferred(self, origin: float | None) -> None:
        """Runs the W work still waiting to be gathered, so .grad is complete
        when the step returns; on a timeline it is a W of the step's last
        microbatch."""
        for i, stage in self.stages.items():
            if stage.weights.waiting:
                self._flush_stage(i, origin)

    def _flush_stage(self, i: int, origin: float | None) -> None:
        stage = self.stages[i]
        t0 = time.perf_counter()
        self._hold(-stage.weights.nbytes)
        stage.weights.flush()
        if self.records is not None:
            last = Action(i, Kind.W, self.schedule.microbatches - 1)
            self.records.append(TimelineRecord(self.rank, last, t0 - origin,
                                               time.perf_counter() - origin))

    def _stage_grads_done(self, i: int, origin: float | None) -> None:
        """Stage ``i`` ran its step's last backward: its W work still waiting
        runs now (nothing more will join it), and ``grads_done`` hears that
        its gradients are final (a data-parallel all-reduce starts there)."""
        if self.stages[i].weights.waiting:
            self._flush_stage(i, origin)
        self.grads_done(i)

    def _unsent(self) -> list[tuple[tuple[str, int, int], int]]:
        """(key, destination rank) of every message of the step not sent yet."""
        out = []
        for a in self.actions:
            if a.kind is Kind.SEND_F:
                key, dst = ("F", a.stage + 1, a.microbatch), self._owner(a.stage + 1)
            elif a.kind is Kind.SEND_B:
                key, dst = ("B", a.stage - 1, a.microbatch), self._owner(a.stage - 1)
            else:
                continue
            if key not in self._sent:
                out.append((key, dst))
        return out

    def _all_backward_sends(self, known) -> list[tuple[tuple[str, int, int], int]]:
        """(key, destination rank) of every gradient this rank's stages send
        in a training step, but those sent or in ``known``."""
        skip = self._sent | {key for key, _ in known}
        return [(("B", s - 1, mb), self._owner(s - 1)) for s in sorted(self.stages) if s > 0
                for mb in range(self.schedule.microbatches)
                if ("B", s - 1, mb) not in skip and self._owner(s - 1) != self.rank]

    def _release(self, key: tuple[int, int]) -> None:
        for pending in self._held.pop(key, ()):
            pending.release()
        self.live_activation_bytes -= self._activations.pop(key, 0)

    def _count(self, key: tuple[int, int], start: int) -> None:
        """Books the bytes autograd saved since ``start`` to ``key``."""
        added = self._saved_bytes.total - start
        self._activations[key] = self._activations.get(key, 0) + added
        self.live_activation_bytes += added
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.live_activation_bytes)

    def _hold(self, delta: int) -> None:
        """Books bytes kept beyond their microbatch's last action (deferred W)."""
        self.live_activation_bytes += delta
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.live_activation_bytes)

    def _timed(self, a: Action, origin: float) -> None:
        """Runs one action and records it; a wait for data becomes a comm record."""
        self._wait_end = None
        t0 = time.perf_counter()
        self._verbs[a.kind](self, a)
        t1 = time.perf_counter()
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            return  # a post; the wait is recorded with its consumer
        if a.kind not in _COMPUTE:
            self.records.append(TimelineRecord(self.rank, a, t0 - origin, t1 - origin, "comm"))
            return
        start = t0
        if self._wait_end is not None:
            start = self._wait_end
            wait = Action(a.stage, _WAIT_KIND[a.kind], a.microbatch)
            self.records.append(TimelineRecord(self.rank, wait, t0 - origin, start - origin, "comm"))
        self.records.append(TimelineRecord(self.rank, a, start - origin, t1 - origin))

    # --- communication verbs ----------------------------------------------------

    def _owner(self, stage: int) -> int:
        return self.schedule.stage_to_rank[stage]

    def _recv(self, a: Action) -> None:
        """RECV verb: posts the receive, unless all were handed to the lanes at the start."""
        if not self._ahead:
            self._post(a)

    def _post(self, a: Action) -> None:
        if a.kind == Kind.RECV_F:
            key, src = ("F", a.stage, a.microbatch), self._owner(a.stage - 1)
        else:
            key, src = ("B", a.stage, a.microbatch), self._owner(a.stage + 1)
        self._pending[key] = self.transport.recv(src, key)

    def _take(self, key: tuple[str, int, int], src_stage: int) -> tuple[list[torch.Tensor], bool]:
        if key in self._local:
            return self._local.pop(key)
        pending = self._pending.pop(key, None)
        if pending is None:  # an unlowered schedule, or a receive not posted early
            pending = self.transport.recv(self._owner(src_stage), key)
        payload = pending.wait()
        self._held.setdefault((key[1], key[2]), []).append(pending)
        if self.records is not None:
            self._wait_end = time.perf_counter()
        return payload

    def _deliver(self, key: tuple[str, int, int], dst_stage: int, payload) -> None:
        """Hands a value to another stage: in memory if it is ours, else queued for SEND."""
        if dst_stage in self.stages:
            tensors, spec = payload
            self._local[key] = ([t.detach().requires_grad_(needs_grad(t)) for t in tensors], spec)
        else:
            self._outbox[key] = payload

    def _send_f(self, a: Action) -> None:
        self._send(("F", a.stage + 1, a.microbatch), a.stage + 1)

    def _send_b(self, a: Action) -> None:
        key = ("B", a.stage - 1, a.microbatch)
        if key not in self._sent:  # else sent by its B already
            self._send(key, a.stage - 1)

    def _send(self, key: tuple[str, int, int], dst_stage: int) -> None:
        tensors, spec = self._outbox.pop(key)
        self._sent.add(key)  # from here on the transport owns it (and its failure)
        self.transport.send(tensors, spec, self._owner(dst_stage), key)

    # --- compute verbs -----------------------------------------------------------

    def _forward(self, a: Action) -> None:
        stage, mb = self.stages[a.stage], a.microbatch
        if a.stage == 0:
            tensors, spec = flatten(self._inputs[mb])
            # An input that wants a gradient enters as a leaf of its own: its
            # gradient is kept (``input_grads``) and carried into the caller's
            # tensor once for the step, as the unsplit batch's backward would.
            leaves = [t.detach().to(stage.device).requires_grad_() if self._train and t.requires_grad
                      else t.to(stage.device) for t in tensors]
        else:
            received, spec = self._take(("F", a.stage, mb), a.stage - 1)
            leaves = [t.requires_grad_(self._train and t.requires_grad) for t in received]
        ckpt = self._train and checkpointed(self.checkpoint, mb, self.schedule.microbatches)
        last = a.stage == self.schedule.stages - 1
        if (a.stage in self._chains and not ckpt and spec is False
                and stage.chain.accepts(leaves[0])):
            self._forward_chain(a, stage, leaves, last)
            return
        shape_key = ("F", ckpt, *[(t.shape, t.dtype) for t in leaves]) if self._train else None
        known = stage.saved_bytes.get(shape_key) if self._train else None
        start = self._saved_bytes.total
        with guarded(self.rng_lock if stage.stochastic else None), self._seeded(stage, a):
            # Where ranks share a generator (a lock), a stage with no random
            # layer keeps no state to replay: replaying would set the shared
            # generator under another rank's seeded forward.
            rng = None if not ckpt else RngState.capture(stage.device) \
                if stage.stochastic or self.rng_lock is None else NO_RANDOM
            counting = self._train and known is None
            pending = deferred.Pending() if self._split and not ckpt else None
            with self._saved_bytes.counting() if counting else nullcontext():
                with forgetful() if ckpt else nullcontext(), self._autocast(), \
                        deferred.collecting(pending) if pending is not None else nullcontext():
                    out = stage.module(unflatten(leaves, spec))
                    loss = self._loss(mb, out) if last and self._train else None
        if self._train:
            if known is not None:
                self._saved_bytes.total += known
            else:
                if pending is not None:  # what deferred layers kept, beside autograd's
                    self._saved_bytes.total += pending.kept_bytes
                if ckpt:  # the kept input is what a checkpointed microbatch holds
                    self._saved_bytes.total += sum(t.numel() * t.element_size() for t in leaves)
                stage.saved_bytes[shape_key] = self._saved_bytes.total - start
            self._count((a.stage, mb), start)
        if last:
            self._finish_forward(mb, out, loss, leaves, rng, spec)
            if self._train:
                self._saved[(a.stage, mb)].pending = pending
            return
        tensors, out_spec = flatten(out)
        self._deliver(("F", a.stage + 1, mb), a.stage + 1, (tensors, out_spec))
        if self._train:
            # Keep graph edges, not the output tensors: once sent, an output's
            # memory is freed unless autograd itself saved it for backward.
            roots = [] if ckpt else [get_gradient_edge(t) for t in tensors if needs_grad(t)]
            self._saved[(a.stage, mb)] = _Saved(roots, leaves, rng=rng, spec=spec, pending=pending)

    def _seeded(self, stage: Stage, a: Action):
        """A stochastic forward's own seed, where ranks share a generator (``rng_seed``)."""
        if self.rng_seed is None or not stage.stochastic:
            return nullcontext()
        return seeded(stage.device, stage_seed(self.rng_seed, a.stage, a.microbatch))

    def _forward_chain(self, a: Action, stage: Stage, leaves: list[torch.Tensor], last: bool
                       ) -> None:
        """F of a stage that runs as a Chain: no graph, the output a fresh leaf."""
        mb = a.microbatch
        out, kept = stage.chain.forward(leaves[0])
        if not self._train:
            if last:
                self._results[mb] = out
            else:
                self._deliver(("F", a.stage + 1, mb), a.stage + 1, ([out], False))
            return
        start = self._saved_bytes.total
        self._saved_bytes.total += stage.chain.saved_bytes(kept)
        # What autograd's output would say: a gradient comes back for it only
        # where something before it (a weight, the input) wants one.
        out.requires_grad_(leaves[0].requires_grad or stage.chain.trains)
        quick = None
        if last and self._known_loss is not None and out.requires_grad:
            quick = self._known_loss.value_and_grad(out, self._target(mb),
                                                    1 / self.schedule.microbatches)
        if quick is not None:
            # The loss and its gradient at once; what is kept is the gradient.
            self._results[mb] = quick[0]
            self._saved_bytes.total += quick[1].numel() * quick[1].element_size()
            saved = _Saved([], leaves, [quick[1]], chain=kept)
        elif last:
            # The loss's graph is autograd's: counted as an eager forward's is.
            shape_key = ("L", out.shape, out.dtype)
            known = stage.saved_bytes.get(shape_key)
            before = self._saved_bytes.total
            with self._saved_bytes.counting() if known is None else nullcontext():
                # A copy, not the leaf itself: loss_fn may change its input in
                # place, as it may autograd's output of a layer (exact, ~3 us).
                loss = self._loss(mb, out.clone() if out.requires_grad else out)
            if known is None:
                stage.saved_bytes[shape_key] = self._saved_bytes.total - before
            else:
                self._saved_bytes.total += known
            self._results[mb] = loss.detach()
            saved = _Saved([loss], leaves, [self._seed(loss)], chain=kept, out=out)
        else:
            self._deliver(("F", a.stage + 1, mb), a.stage + 1, ([out], False))
            saved = _Saved([], leaves, chain=kept)
        self._count((a.stage, mb), start)
        self._saved[(a.stage, mb)] = saved

    def _chain_input(self, a: Action, saved: _Saved) -> deferred.Pending:
        """I of a Chain stage: the input gradient (sent on) and W's share."""
        if saved.out is not None:  # the last stage: the loss's gradient first
            backward_full(saved.roots, saved.grads, self.keep_graphs)
            grad = saved.out.grad
        else:
            grad = saved.grads[0] if saved.grads else None
        x = saved.leaves[0]
        if grad is None:  # the output needed no gradient: nothing before it does
            self._send_input_grads(a.stage, a.microbatch, saved.leaves, [None])
            return deferred.Pending()
        gx, pending = self.stages[a.stage].chain.backward_input(saved.chain, grad, x.requires_grad)
        self._send_input_grads(a.stage, a.microbatch, saved.leaves, [gx])
        return pending

    def _autocast(self):
        return autocast(self._amp, self._amp_cache) if self._amp else nullcontext()

    def _target(self, mb: int) -> Any:
        """One microbatch's target, on the last stage's device."""
        if self._targets is None:
            raise ValueError(
                f"target is None on rank {self.rank}, which holds the last stage: it computes "
                "loss_fn(output, target) there (ranks without the last stage may pass None)")
        target = self._targets[mb]
        device = self.stages[self.schedule.stages - 1].device
        return tuple(t.to(device) for t in target) if isinstance(target, tuple) else target.to(device)

    def _loss(self, mb: int, out: Value) -> torch.Tensor:
        """The loss of one microbatch, as a 0-dim tensor (``_seed`` scales its gradient)."""
        loss = self._loss_fn(out, self._target(mb))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
        return loss if loss.dim() == 0 else loss.reshape(())

    def _seed(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient backward starts a microbatch's loss from: 1/m, the
        step's mean (what a division of the loss by m would pass on, without
        the op and its node)."""
        return torch.full_like(loss, 1 / self.schedule.microbatches)

    def _finish_forward(self, mb, out, loss, leaves, rng, spec) -> None:
        if not self._train:
            self._results[mb] = out
            return
        self._results[mb] = loss.detach()
        roots, grads = ([], [None]) if rng is not None else ([loss], [self._seed(loss)])
        self._saved[(self.schedule.stages - 1, mb)] = _Saved(roots, leaves, grads, rng, spec)

    def _recompute(self, stage_index: int, mb: int, saved: _Saved) -> None:
        """A checkpointed microbatch: its forward again, now keeping the graph."""
        stage = self.stages[stage_index]
        shape_key = ("R", *[(t.shape, t.dtype) for t in saved.leaves])
        known = stage.saved_bytes.get(shape_key)
        start = self._saved_bytes.total
        counting = self._saved_bytes.counting() if known is None else nullcontext()
        saved.pending = deferred.Pending() if self._split else None
        collect = deferred.collecting(saved.pending) if self._split else nullcontext()
        with recompute(saved.rng, self.rng_lock if stage.stochastic else None), counting, \
                self._autocast(), collect:
            out = stage.module(unflatten(saved.leaves, saved.spec))
            if stage_index == self.schedule.stages - 1:
                loss = self._loss(mb, out)
                saved.roots, saved.grads = [loss], [self._seed(loss)]
            else:
                tensors, _ = flatten(out)
                saved.roots = [get_gradient_edge(t) for t in tensors if needs_grad(t)]
        saved.rng = None
        if known is not None:
            self._saved_bytes.total += known
        else:
            if saved.pending is not None:  # what deferred layers kept, beside autograd's
                self._saved_bytes.total += saved.pending.kept_bytes
            stage.saved_bytes[shape_key] = self._saved_bytes.total - start
        self._count((stage_index, mb), start)

    def _grads_for(self, stage: int, mb: int) -> _Saved:
        saved = self._saved[(stage, mb)]
        if saved.rng is not None:  # recompute first: the gradient may still be on its way
            self._recompute(stage, mb, saved)
        if saved.grads is None:
            grads, _ = self._take(("B", stage, mb), stage + 1)
            saved.grads = list(grads)
        return saved

    def _send_input_grads(self, stage: int, mb: int, leaves, grads) -> None:
        """The gradient of each stage input that wants one (zeros where none
        reached it): to the previous stage, or kept for the caller on stage 0."""
        out = [
            g if g is not None else torch.zeros_like(t)
            for t, g in zip(leaves, grads)
            if t.requires_grad
        ]
        if stage == 0:
            if out:
                self.input_grads[mb] = out
            return
        self._deliver(("B", stage - 1, mb), stage - 1, (out, False))

    def _backward(self, a: Action) -> None:
        """B: I, then its W at once (or waiting to be gathered with others)."""
        key = (a.stage, a.microbatch)
        saved = self._grads_for(*key)
        del self._saved[key]
        pending = self._input_grads(a, saved)
        if saved.chain is not None and key in self._send_after_i:
            # The gradient the previous stage waits for leaves before W
            # runs, not after: W only feeds this rank's .grad.
            self._send_b(a)
        if pending is not None:
            self._queue_weight(self.stages[a.stage], pending)

    def _backward_input(self, a: Action) -> None:
        """I: the input gradients; the layers with a weight rule (and chain
        stages) leave their weight gradients for W (``fastpipe.runtime.deferred``),
        the rest accumulate now."""
        key = (a.stage, a.microbatch)
        saved = self._grads_for(*key)
        del self._saved[key]
        pending = self._input_grads(a, saved) or deferred.Pending()
        self._hold(pending.grad_bytes)
        self._weights[key] = pending

    def _input_grads(self, a: Action, saved: _Saved) -> deferred.Pending | None:
        """The stage's input gradients, sent on, and what its W has to do."""
        if saved.chain is not None:
            pending = self._chain_input(a, saved)
        else:
            grads = deferred.backward_input(saved.roots, saved.grads, saved.leaves,
                                            self.stages[a.stage].params, saved.pending,
                                            self.keep_graphs)
            self._send_input_grads(a.stage, a.microbatch, saved.leaves, grads)
            pending = saved.pending
        if pending is not None:
            # What W reads that may be a view of a received buffer, handed
            # back after W: cloned if W's work waits beyond it.
            pending.borrowed = {_storage(t) for t in (*saved.leaves, *(saved.grads or ()))
                                if isinstance(t, torch.Tensor)}
        return pending

    def _backward_weight(self, a: Action) -> None:
        pending = self._weights.pop((a.stage, a.microbatch))
        self._hold(-pending.grad_bytes)
        self._queue_weight(self.stages[a.stage], pending)

    def _queue_weight(self, stage: Stage, pending: deferred.Pending) -> None:
        """W of one microbatch: now, or gathered with others (``WeightQueue``)."""
        before = stage.weights.nbytes
        stage.weights.add(pending, self.gather_w)
        self._hold(stage.weights.nbytes - before)
