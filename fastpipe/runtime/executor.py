"""One executor loop for every schedule: run a rank's lowered action list.

The schedule says *what* to run; this module knows *how*: each action kind
maps to one small verb (``_send_f``, ``_recv`` ... here; ``_forward``,
``_backward``, ``_backward_input``, ``_backward_weight`` in
``runtime/stage_compute.py``). A
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
from dataclasses import dataclass, field, replace
from typing import Any

import contextlib
import threading
import time
from contextlib import nullcontext

import torch
from torch import nn
from torch.profiler import record_function

from fastpipe._microbatch import Value, needs_grad
from fastpipe.runtime import deferred
from fastpipe.runtime.buffers import last_use
from fastpipe.runtime.chain import Chain
from fastpipe.runtime.losses import known_loss
from fastpipe.runtime.checkpoint import norm_layers, stochastic
from fastpipe.runtime.eager_checks import accumulator_hooked
from fastpipe.runtime.memory import SavedBytes
from fastpipe.runtime.stage_compute import Saved, StageCompute
from fastpipe.runtime.threads import Autocast, autocast
from fastpipe.runtime.transport import CallMismatch, PeerError, Transport
from fastpipe.schedules import Action, Kind, Schedule, TimelineRecord

__all__ = ["LossFn", "RankExecutor", "Stage", "last_backward"]

LossFn = Callable[[Any, Any], torch.Tensor]
_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
_WAIT_KIND = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B, Kind.I: Kind.RECV_B}


@dataclass
class Stage:
    """One contiguous slice of the user's layers, placed on a device."""

    index: int
    module: nn.Sequential
    device: torch.device
    # "on": the layers as a Chain where they all are ones it knows (native
    # where fastpipe._chain is built); "python": its ops issued from Python;
    # "off": autograd (``Switches.chains``).
    chains: str = "on"
    layers: range | None = None  # the model's layer indices this stage holds
    params: list[torch.Tensor] = field(init=False)

    stochastic: bool = field(init=False)  # holds dropout-like layers
    norms: list = field(init=False)  # layers with running statistics (a recomputation keeps them)
    # Saved-activation bytes of a forward, by (kind, input shapes and dtypes):
    # counted with hooks the first time, then looked up (hooks cost ~5 %).
    saved_bytes: dict = field(default_factory=dict, init=False)
    # Its layers' deferring forwards, by id: their plans are kept from step
    # to step (``deferred.install``).
    forwards: dict = field(default_factory=dict, init=False)
    # W work of a split schedule waiting to be gathered (``deferred.WeightQueue``).
    weights: deferred.WeightQueue = field(default_factory=deferred.WeightQueue, init=False)
    # The layers as a Chain (``fastpipe.runtime.chain``) when they all are
    # ones it knows: forward and backward then run without a graph.
    chain: Chain | None = field(init=False)

    def __post_init__(self) -> None:
        self.refresh()
        self.stochastic = stochastic(self.module)
        self.norms = norm_layers(self.module)
        self.chain = None if self.chains == "off" else Chain.of(self.module, self.chains == "on")

    def refresh(self) -> None:
        """Re-reads the parameters, after a module's entries changed (local
        mode swaps replicas of parameters tied across ranks in for a call)."""
        self.params = [p for p in self.module.parameters() if p.requires_grad]


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10 (no PEP 678) ``__notes__`` alone."""
    with contextlib.suppress(AttributeError, TypeError):  # a type that takes no attributes
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]


def _names(module: nn.Module, most: int = 4) -> list[str]:
    kinds = [type(m).__name__ for m in module]
    return kinds if len(kinds) <= most else [*kinds[:most - 1], "...", kinds[-1]]


def last_backward(actions: Sequence[Action]) -> dict[int, int]:
    """Index of each stage's last B, I or W in a rank's list."""
    return {a.stage: i for i, a in enumerate(actions) if a.kind in (Kind.B, Kind.I, Kind.W)}


def _range(a: Action) -> record_function:
    return record_function(f"fastpipe.{a.kind.name} stage={a.stage} mb={a.microbatch}")


# A rank's action list -> (that list, its tables): an executor is made every
# step, before the rank's first action, so the tables are worked out once per
# list (docs/benchmarks.md, "A step's start").
_TABLES: dict[int, tuple] = {}


def _tables(actions: Sequence[Action]) -> tuple[dict, dict, set]:
    """What the loop looks up by a rank's action list, worked out once per
    list: after the action at index i, the buffers of which (stage, mb) go
    back (``release_at``), and which stage ran its step's last backward
    (``grads_done_at``); the (stage, mb) of each B whose very next action
    sends its input gradient (a stage whose B defers W sends it between I and W)."""
    hit = _TABLES.get(id(actions))
    if hit is not None and hit[0] is actions:
        return hit[1]
    tables = (
        {i: key for key, i in last_use(actions).items()},
        {i: stage for stage, i in last_backward(actions).items()},
        {(a.stage, a.microbatch) for a, b in zip(actions, actions[1:])
         if a.kind is Kind.B and b.kind is Kind.SEND_B and (b.stage, b.microbatch) == (a.stage, a.microbatch)},
    )
    if len(_TABLES) >= 64:  # Pipes come and go: forget the oldest lists
        _TABLES.clear()
    _TABLES[id(actions)] = (actions, tables)
    return tables


class RankExecutor(StageCompute):
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
            runs a whole backward without it (``docs/benchmarks.md``, "Figures
            behind design choices").
        rng_seed: local mode with stochastic stages: a number drawn once for
            the step; each stochastic forward then runs under the lock with
            its generator seeded from it and its (stage, microbatch)
            (``checkpoint.seeded``), so ``torch.manual_seed`` makes a step
            repeat whatever order the ranks' threads ran in.
        gather_w: deferred W of several microbatches gathered into one GEMM
            per layer, fused into ``.grad`` (``deferred.WeightQueue``); False
            runs each W at once, with autograd's rounding.
        known_losses: a known loss after a chain stage gives its value and
            gradient at once (``fastpipe.runtime.losses``); False: autograd.
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
        fused_wgrad: bool = True,
        autocast: tuple[Autocast, bool] = ((), True),
        python_chains: bool = True,
        rng_seed: int | None = None,
        gather_w: bool = True,
        known_losses: bool = True,
        grads_done: Callable[[int], None] | None = None,
    ) -> None:
        self.rank = rank
        self.grads_done = grads_done
        self.python_chains = python_chains
        self.gather_w, self.known_losses = gather_w, known_losses
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
        # A timed step on a GPU: (record's index, start event, end event) of
        # each compute action, read once the step's work is done.
        self._events: list | None = None
        self._wait_event = None
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
        self._release_at, self._grads_done_at, self._send_after_i = _tables(self.actions)
        # A failed step: (key, destination) of the messages it never sent
        # (the peers waiting for them get abort notices instead); None otherwise.
        self.unsent: list | None = None
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
        installed = self._begin(inputs, targets, loss_fn, train)
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
            self.unsent = unsent
            self.transport.fail(exc, unsent)
            raise
        finally:
            for i in self._chains:  # no reference to the parameters outlives the step
                self.stages[i].chain.unbind()
            for layers in installed:
                deferred.uninstall(layers)
            if self._weights or any(st.weights.holds for st in self.stages.values()):
                for st in self.stages.values():  # a failed step: W's work is dropped
                    st.weights.clear()
        leftovers = [
            name for name in ("_saved", "_weights", "_outbox", "_pending", "_local", "_held")
            if getattr(self, name)
        ]
        if leftovers:
            raise AssertionError(f"rank {self.rank}: the schedule left {leftovers} non-empty")
        return self._results

    def _begin(self, inputs, targets, loss_fn, train: bool) -> list:
        """A step's state, emptied as its actions run; the layers that defer
        their weight gradients (returned, for ``deferred.uninstall``); every
        receive handed to the transport where it posts ahead."""
        self._inputs, self._targets, self._loss_fn, self._train = inputs, targets, loss_fn, train
        self._pending: dict[tuple[str, int, int], Any] = {}
        self._local: dict[tuple[str, int, int], tuple[list[torch.Tensor], bool]] = {}
        self._saved: dict[tuple[int, int], Saved] = {}
        self._outbox: dict[tuple[str, int, int], tuple[list[torch.Tensor], bool]] = {}
        self._weights: dict[tuple[int, int], deferred.Pending] = {}
        self._results: dict[int, Any] = {}
        # Gradients of the first stage's inputs, by microbatch: the caller
        # carries them into its own tensors (fastpipe._outputs.backward_into_inputs).
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
        self._known_loss = known_loss(loss_fn) if train and self.known_losses and last in self._chains \
            else None
        # A split schedule (I and W actions), or fused_wgrad: the stages'
        # layers defer their weight gradients to W, or to the end of B
        # (``fastpipe.runtime.deferred``); a chain stage's too, for the
        # microbatches it runs through autograd (checkpointed ones, inputs
        # the chain does not take). A stage with hooks on a parameter's
        # AccumulateGrad node keeps autograd's backward (all in I): only
        # autograd's own accumulation runs them.
        split = train and (self.fused_wgrad or any(a.kind is Kind.W for a in self.actions))
        self._defers = {i for i, st in self.stages.items()
                        if not accumulator_hooked(st.params)} if split else set()
        installed = [deferred.install(self.stages[i].module, self.stages[i].forwards)
                     for i in sorted(self._defers)]
        self.transport.begin(self.actions)
        self._ahead = self.transport.posts_ahead
        if self._ahead:
            # Hand every receive of the step to the transport now: each is
            # posted as soon as its buffer ring has a slot, so the sender's
            # message lands when it is sent instead of waiting for the consumer.
            for action in self.actions:
                if action.kind in (Kind.RECV_F, Kind.RECV_B):
                    self._post(action)
        return installed

    def _loop(self) -> None:
        verbs, release_at = self._verbs, self._release_at
        origin, self._events = None, None
        if self.records is not None:
            origin = self.origin if self.origin is not None else time.perf_counter()
            if self._on_gpu():
                self._events = []
        # Under a torch profiler every action is a range of its own
        # ("fastpipe.F stage=1 mb=3"), so the user's trace shows the schedule;
        # without one, the loop has nothing extra to do.
        profiling = torch.autograd.profiler._is_profiler_enabled
        done_at = self._grads_done_at if self.grads_done is not None and self._train else {}
        action = None
        try:
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
            action = None
            with record_function("fastpipe.W gathered") if profiling else nullcontext():
                self._flush_deferred(origin)
        except Exception as exc:
            if not isinstance(exc, PeerError):  # a peer's failure names its own place
                _add_note(exc, self._where(action))
            raise
        self.transport.finish()
        if self._events:
            self._device_times()

    def _on_gpu(self) -> bool:
        return any(st.device.type == "cuda" for st in self.stages.values())

    def _event(self):
        """A timing event after the work queued so far on this thread's current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _device_times(self) -> None:
        """Each timed compute action's GPU seconds, into its record's
        ``device``: on a GPU the host's span of an action is the time to
        queue it, not what it costs, and the order a zero-bubble Pipe takes
        after its measured step is simulated from these costs. One host wait
        for the step's last event, in the measured step only."""
        events, self._events = self._events, None
        events[-1][2].synchronize()
        for i, start, end in events:
            self.records[i] = replace(self.records[i], device=start.elapsed_time(end) / 1e3)

    def _where(self, a: Action | None) -> str:
        """Where in the pipeline an exception was raised, as a note on it."""
        if a is None:
            return f"fastpipe: raised on pipeline rank {self.rank} in the gathered W at the step's end"
        stage = self.stages.get(a.stage)
        layers = stage.layers if stage is not None else None
        held = "" if layers is None else (
            f" (layer {layers.start}" if len(layers) == 1 else f" (layers {layers.start}-{layers.stop - 1}")
        held += "" if layers is None else f" of the model: {', '.join(_names(stage.module))})"
        return (f"fastpipe: raised on pipeline rank {self.rank} in {a.kind.name} of stage "
                f"{a.stage}{held}, microbatch {a.microbatch}")

    def _flush_deferred(self, origin: float | None) -> None:
        """Runs the W work still waiting to be gathered, so .grad is complete
        when the step returns; on a timeline it is a W of the step's last
        microbatch."""
        for i, stage in self.stages.items():
            if stage.weights.holds:
                self._flush_stage(i, origin)

    def _flush_stage(self, i: int, origin: float | None) -> None:
        stage = self.stages[i]
        t0 = time.perf_counter()
        began = self._event() if self._events is not None else None
        self._hold(-stage.weights.nbytes)
        stage.weights.flush()
        if self.records is not None:
            last = Action(i, Kind.W, self.schedule.microbatches - 1)
            if began is not None:
                self._events.append((len(self.records), began, self._event()))
            self.records.append(TimelineRecord(self.rank, last, t0 - origin,
                                               time.perf_counter() - origin))

    def _stage_grads_done(self, i: int, origin: float | None) -> None:
        """Stage ``i`` ran its step's last backward: its W work still waiting
        runs now (nothing more will join it), and ``grads_done`` hears that
        its gradients are final (a data-parallel all-reduce starts there)."""
        if self.stages[i].weights.holds:
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

    def _borrows(self, key: tuple[int, int]) -> bool:
        """A received buffer of ``(stage, mb)`` is still held: its tensors are
        views into memory handed back after the microbatch's last action
        (local transfers and cast copies are tensors of their own)."""
        return any(p.holds_buffer for p in self._held.get(key, ()))

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

    def _rebook(self, key: tuple[int, int], nbytes: int) -> None:
        """``key`` holds ``nbytes`` from now on, in place of what it was booked."""
        self.live_activation_bytes += nbytes - self._activations.get(key, 0)
        self._activations[key] = nbytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.live_activation_bytes)

    def _hold(self, delta: int) -> None:
        """Books bytes kept beyond their microbatch's last action (deferred W)."""
        self.live_activation_bytes += delta
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.live_activation_bytes)

    def _timed(self, a: Action, origin: float) -> None:
        """Runs one action and records it; a wait for data becomes a comm record."""
        self._wait_end = self._wait_event = None
        timed = self._events is not None and a.kind in _COMPUTE
        began = self._event() if timed else None
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
        if timed:  # from after the stream's wait for the input, if there was one
            self._events.append((len(self.records), self._wait_event or began, self._event()))
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
            if self._events is not None:  # the stream has queued its wait for the data
                self._wait_event = self._event()
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
