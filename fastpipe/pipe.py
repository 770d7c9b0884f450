"""``Pipe``: the ``nn.Sequential`` drop-in that trains with a pipeline schedule."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpipe import _args
from fastpipe import _microbatch as mbatch
from fastpipe._dist_run import DistRunner
from fastpipe._local_run import LocalRunner
from fastpipe._outputs import backward_into_inputs, no_backward
from fastpipe._placement import Placement
from fastpipe._stages import changed_layer
from fastpipe.runtime.executor import LossFn, Stage
from fastpipe.runtime.transport.groups import all_reduce, broadcast
from fastpipe.schedules import Schedule, lower, orders_by_cost

# The training step whose measured action costs reorder a zero-bubble
# schedule given by name (counted from 0): the first runs cold (plans made,
# buffers grown, pages faulted), the second as the rest will.
ORDER_STEP = 1

__all__ = ["Pipe"]

log = logging.getLogger(__name__)

DeviceLike = str | int | torch.device


class Pipe(nn.Module):
    """Pipeline-parallel wrapper of an ``nn.Sequential``.

    The model's children are split into ``ranks × stages_per_rank`` stages of
    contiguous layers and run by a schedule over ``chunks`` microbatches.
    **Local mode** (no process group): each pipeline rank is a thread of this
    process on its own entry of ``devices``. **Distributed mode** (a process
    group is initialized, e.g. by torchrun): one pipeline rank per process;
    every rank passes the same arguments, inputs are read on the first
    stage's rank and targets on the last's (others may pass ``None``).
    ``docs/design/pipe.md`` says how each mode and option works, and why.

    The user's layer objects are kept, not copied (local mode moves each
    stage's layers to its device). After ``step(x, target, loss_fn)`` every
    parameter of a stage this process holds has, accumulated into ``.grad``
    like a normal backward, the gradient of the mean over microbatches of
    ``loss_fn(model(x_mb), target_mb)`` (equal up to float rounding), a
    parameter used by several stages (a tied embedding) the sum of every
    use's, on every rank that holds it; ``step`` returns that mean loss on
    every rank. ``pipe.parameters()`` and ``pipe.state_dict()`` are the held
    stages' (build a distributed rank's optimizer over the former; the
    latter, under the model's names, is what ``torch.distributed.checkpoint``
    saves and reshards).

    Args:
        model: the ``nn.Sequential`` to split. Built on the meta device
            (``with torch.device("meta"):``), it holds no data: this
            process makes its own stages' tensors on their devices (the
            same Parameter objects; floating ones full of NaN), and the
            first ``step`` or forward raises ValueError (on every rank)
            until each was written, by a load or an initialization
            (``balance="auto"`` cannot time such a model).
        chunks: microbatches per step; the batch is split along dim 0 into
            exactly this many parts (sizes differ by at most one).
        schedule: a name from ``fastpipe.schedules.names()`` or a ``Schedule``.
            A zero-bubble schedule given by name (zb-h1, zb-h2, zbv) is
            reordered once, after its second training step, for the F, I and
            W times that step measured on every rank, where that simulates
            faster without holding more (``pipe.schedule`` is then that
            order; not under ``torch.use_deterministic_algorithms``, since
            the order moves W's rounding); a ``Schedule`` runs as given.
        balance: layers per stage, e.g. ``[3, 5]``; None balances parameter
            counts; ``"auto"`` balances layer times measured on the first
            microbatch of the first ``step``, and runs a zero-bubble
            schedule given by name (zb-h1, zb-h2, zbv) in the order for the
            measured F, I and W where that simulates faster
            (``schedules.build(costs=)``); ``pipe.schedule`` is then that one.
        devices: local mode: one device per pipeline rank. Distributed mode:
            optional, one per rank (default: CPU for gloo, the current CUDA
            device for NCCL).
        stages_per_rank: virtual stages per rank (interleaved, looped, V schedules).
        group: the process group (default: the world, when initialized).
        mesh: instead of ``group``, a ``DeviceMesh`` with dimensions
            ``("dp", "pp")`` (or ``("pp",)``): the pipeline runs over this
            process's ``pp`` ranks and each ``dp`` replica passes its own
            shard of the batch; ``step`` averages gradients and the loss over
            ``dp``. Replicas must start from equal weights (the first
            ``step`` raises ValueError on every rank if they differ).
        timeout: seconds a rank waits for a peer (or a free buffer slot)
            before raising TimeoutError.
        overlap: run communication on lanes of the native ring so compute
            never waits for a send; ``False`` runs it inline; ``None``
            (default): lanes unless every device is a CPU. Refused on NCCL.
        checkpoint: ``"never"`` (default), ``"except_last"`` or ``"always"``:
            which microbatches recompute their stage activations in backward
            (dropout replays, norm layers' running statistics are updated
            once; ``fastpipe.is_recomputing()`` tells a layer).
        recompute: ``"none"`` (default) or ``"selective"``
            (``fastpipe.selective_recompute`` applied to the model in place).
        wire_dtype: activations cross rank boundaries rounded to this dtype
            (``torch.bfloat16``, ``torch.float16``, ``torch.float8_e4m3fn``)
            and cast back on arrival; integers never. None: exact.
        grad_wire_dtype: the same for the gradients sent back.
        plan: a ``fastpipe.plan(...)`` result whose chunks, schedule,
            balance, stages_per_rank and checkpoint mode are used.
        fused_wgrad: B too defers weight gradients as zero-bubble W does
            (``fastpipe.runtime.deferred``; default): each Linear's added
            into ``.grad`` by one GEMM, gathered over microbatches while
            that holds less than the weight's bytes; cheaper than
            autograd's B, rounded as the gathered sum (autograd's with
            ``FASTPIPE_CHAIN_GATHER=0``). False: B is autograd's backward.
        shm: distributed mode on one host: messages through shared-memory
            rings instead of gloo. ``None`` (default): when the group is
            gloo, the devices CPUs, every rank on this host and ``overlap``
            off; ``True``: required (ValueError saying why not); ``False`` (or
            ``FASTPIPE_SHM=0``): never. ``pipe.shm`` tells which was taken.
        free_remote: distributed mode: the layers other ranks hold keep
            their tensors' shapes on the meta device and their data is freed.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> pipe = Pipe(model, chunks=4, schedule="1f1b", devices=["cpu", "cpu"])
        >>> loss = pipe.step(torch.randn(16, 8), torch.randn(16, 1), nn.functional.mse_loss)
    """

    def __init__(
        self,
        model: nn.Sequential,
        chunks: int = 8,
        schedule: str | Schedule = "1f1b",
        balance: Sequence[int] | str | None = None,
        devices: Sequence[DeviceLike] | None = None,
        stages_per_rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        mesh=None,
        timeout: float = 300.0,
        overlap: bool | None = None,
        checkpoint: str = "never",
        recompute: str = "none",
        wire_dtype: torch.dtype | None = None,
        grad_wire_dtype: torch.dtype | None = None,
        plan=None,
        fused_wgrad: bool = True,
        shm: bool | None = None,
        free_remote: bool = False,
    ) -> None:
        super().__init__()
        cfg = _args.settings(model, chunks, schedule, balance, devices, stages_per_rank, group, mesh,
                             timeout, overlap, checkpoint, recompute, wire_dtype, grad_wire_dtype,
                             plan, fused_wgrad, shm, free_remote)
        self._settings = cfg
        self.module = model
        # What users and the code below read, as attributes (fastpipe._args.Settings has them all).
        self.chunks, self.schedule, self.devices = cfg.chunks, cfg.schedule, cfg.devices
        self.group, self.dp_group, self.distributed, self.rank = (
            cfg.group, cfg.dp_group, cfg.distributed, cfg.rank)
        self.overlap, self.timeout, self.checkpoint, self.recompute = (
            cfg.overlap, cfg.timeout, cfg.checkpoint, cfg.recompute)
        self.fused_wgrad, self.free_remote = cfg.fused_wgrad, cfg.free_remote
        self._lowered = lower(self.schedule)
        self._forward_only = lower(_args.forward_schedule(self.schedule))
        self._place = Placement(model, cfg)
        if self.distributed:
            self._place.check_ranks_agree()
        elif self._place.problem is not None:
            raise ValueError(self._place.problem)
        # Who runs a step: this process's rank (distributed), or every rank as a thread.
        self._runner = DistRunner(cfg) if self.distributed else LocalRunner(
            cfg, self._lowered, self._forward_only)
        self.shm = self.distributed and self._runner.shm_link is not None
        self._grad_average = None  # GradAverage over dp_group, made with the stages
        # Replicas and tied copies are compared before the first step (and after
        # a load); tensors made from a model built on meta must be written by
        # then, and before the first forward.
        self._weights_checked = not self.distributed and not self._place.fresh
        self._written_checked = self._weights_checked
        self._recording: list | None = None  # set by step_with_timeline
        # A zero-bubble schedule given by name is reordered once for the
        # action costs measured in this training step (``_order_by_step``).
        self._steps = 0
        self._order_at = ORDER_STEP if cfg.by_name and orders_by_cost(self.schedule.name) else None
        if self._place.stages is not None and cfg.free_remote:  # last: nothing above may fail after it
            self._place.free_remote()
        log.info("pipe: %s, %d ranks, balance %s", self.schedule.name, self.schedule.ranks,
                 self.balance)

    @property
    def balance(self) -> list[int] | None:
        """Layers per stage (None with ``balance="auto"`` until the first step)."""
        return self._place.balance

    @property
    def settings(self) -> _args.Settings:
        """The arguments as checked and resolved, and the ``FASTPIPE_*`` switches read when built."""
        return self._settings

    @property
    def _stages(self) -> dict[int, dict[int, Stage]] | None:
        return self._place.stages

    def memory_stats(self) -> dict[int, dict[str, int]]:
        """Bytes per pipeline rank held by this process, as the executor accounts them.

        Returns:
            ``{rank: {"params", "grads", "activations_peak", "peak"}}``:
            parameter and current gradient bytes of the rank's stages, the
            most saved-activation bytes alive at once during the last step
            (autograd's saved tensors, parameters excluded, counted as they
            are saved and freed microbatch by microbatch; under a split
            schedule, from a microbatch's I to its W, what W reads), and
            their sum.
        """
        out = {}
        for rank in self._place.ranks():
            # Once each: stages of one rank may share a parameter.
            params = list({id(p): p for st in (self._stages or {}).get(rank, {}).values()
                           for p in st.module.parameters()}.values())
            p_bytes = sum(p.numel() * p.element_size() for p in params)
            g_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
            act = self._runner.memory.get(rank, 0)
            out[rank] = {"params": p_bytes, "grads": g_bytes, "activations_peak": act,
                         "peak": p_bytes + g_bytes + act}
        return out

    def step(self, x: Any, target: Any, loss_fn: LossFn, scaler=None) -> torch.Tensor:
        """One training step: forward and backward of every microbatch.

        Inside ``torch.autocast(...)`` the forwards, the loss and any
        recomputation run under the caller's region and the backward outside
        it, as in the usual AMP loop, on every rank. ``scaler`` (a
        ``torch.amp.GradScaler``; distributed: a ``ShardedGradScaler`` over
        the pipeline's ranks): the backward runs from the scaled loss, the
        loss returned is unscaled; then ``scaler.step`` and ``update`` as usual.

        Returns:
            The mean over microbatches of ``loss_fn``, detached, on every rank.

        Raises:
            RuntimeError: called with gradients disabled (``torch.no_grad()``).
            ValueError / TypeError: inputs that cannot be split into ``chunks``.
        """
        measure = self._order_at is not None and self._steps >= self._order_at
        own = measure and self._recording is None  # else step_with_timeline records it
        if own:
            self._recording = []
        try:
            loss = self._train_step(x, target, loss_fn, scaler)
        finally:
            records = self._recording
            if own:
                self._recording = None
        self._steps += 1
        if measure:
            self._order_at = None  # once
            self._order_by_step(records)
        return loss

    def _train_step(self, x: Any, target: Any, loss_fn: LossFn, scaler) -> torch.Tensor:
        loss_fn, factor = self._begin_step(x, loss_fn, scaler, target)
        inputs, targets, refused = self._split_inputs(x, target)
        tied = self._place.tied
        if self.dp_group is not None and self._grad_average is None:
            self._grad_average = self._place.grad_average(self._lowered)
        average, averaging = self._grad_average, False
        if tied is not None:
            tied.begin()  # .grad of parameters tied across ranks: this step's share only
        if average is not None:
            average.begin()
        try:
            self._runner.input_grads = {}
            try:
                results = self._run(self._lowered, inputs, targets, loss_fn, train=True, refuse=refused)
                grads = self._runner.input_grads
            finally:
                self._runner.input_grads = {}  # a failed step's are dropped
            loss = self._mean_loss(results)  # first: peers wait for it in distributed mode
            if grads:
                backward_into_inputs(x, grads, self.chunks)
            if tied is not None or average is not None:
                self._runner.finish_loss_broadcast()
            if tied is not None:
                tied.reduce()
            if average is not None:
                averaging = True
                loss = average.average(loss)
            if factor is not None:
                loss = loss / factor.to(loss.device)
        except BaseException as exc:
            if tied is not None:
                if self.distributed and self._runner.joins_after_failure():
                    try:  # the others are in the tied sum: it tells them of this failure
                        tied.reduce(failed=True, timeout=self.timeout)
                    except Exception:  # noqa: BLE001 - the step's own error is what the caller gets
                        pass
                tied.restore()  # .grad as before the step, the step's share dropped
            if average is not None:
                if not averaging and isinstance(exc, Exception):
                    average.fail()  # the other replicas must not wait for this one's gradients
                self._runner.broken = self._runner.broken or exc  # replicas went out of step
            raise
        return loss

    def _begin_step(self, x: Any, loss_fn: LossFn, scaler, target: Any = None
                    ) -> tuple[LossFn, torch.Tensor | None]:
        """Checks a step's arguments, makes the stages (``balance="auto"``) and
        compares copies (first step); ``(loss_fn, factor)``, scaled by ``scaler``."""
        if not torch.is_grad_enabled():
            where = ("torch.inference_mode()" if torch.is_inference_mode_enabled()
                     else "torch.no_grad()")
            raise RuntimeError(f"Pipe.step needs autograd; it was called inside {where}")
        self._check_not_broken()
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        # The loss is computed on the last stage's device (local mode), or this rank's.
        device = self.devices[self.rank if self.distributed else self.schedule.stage_to_rank[-1]]
        factor = _args.loss_scale(scaler, self.group, self.distributed, device)
        if self._stages is None:
            self._split_by_time(x, loss_fn, target)
        if not self._weights_checked:
            self._place.check_weights()
            self._weights_checked = self._written_checked = True
        return (loss_fn if factor is None else _args.scaled_loss(loss_fn, factor)), factor

    def _split_by_time(self, x: Any, loss_fn: LossFn | None = None, target: Any = None) -> None:
        """balance="auto" at the first step or forward: the split, then the
        zero-bubble order for the measured costs where the placement chose one.
        Before anything ran, so no receive ring was sized for the old order.
        A step's ``loss_fn`` and ``target`` are profiled with the last layer."""
        self._place.split_by_time(x, loss_fn, target)
        if self._place.order is not None:
            self._run_order(self._place.order)

    def _run_order(self, schedule) -> None:
        """Runs ``schedule``, the same schedule's actions in another order
        (same placement and microbatches), from the next step on."""
        self.schedule = schedule
        self._lowered = lower(schedule)
        self._forward_only = lower(_args.forward_schedule(schedule))
        self._runner.set_schedules(self._lowered, self._forward_only)
        log.info("pipe: %s ordered by the measured stage costs", schedule.name)

    def _order_by_step(self, records: list) -> None:
        """After the step ``records`` timed, runs a zero-bubble schedule in the
        order its measured action costs favour (``_plan.order_measured``),
        from the next step on; every rank (and replica) takes the same order.

        Skipped where torch is asked for deterministic algorithms on any
        rank: the order changes how W sums microbatches, so the rounding of
        later steps would depend on timings.
        """
        from fastpipe._plan import order_measured

        kinds, stages = "FBIW", self.schedule.stages
        # Seconds per (stage, kind), then whether deterministic algorithms are
        # on: each rank fills its own stages', the sum is everyone's.
        sums = torch.zeros(stages * len(kinds) + 1, dtype=torch.float64)
        for r in records:
            if r.track == "compute":
                sums[r.action.stage * len(kinds) + kinds.index(r.action.kind.value)] += r.seconds
        sums[-1] = float(torch.are_deterministic_algorithms_enabled())
        if self.distributed:
            self._runner.finish_loss_broadcast()
            device = self.devices[self.rank]
            sums = sums.to(device)
            all_reduce(sums, group=self.group)
            if self.dp_group is not None:  # every replica runs the first one's order
                broadcast(sums, src=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
            sums = sums.cpu()
        if sums[-1] > 0:
            return
        seconds = {(i // len(kinds), kinds[i % len(kinds)]): t
                   for i, t in enumerate(sums[:-1].tolist()) if t > 0}
        chosen = order_measured(self.schedule, seconds)
        if chosen is None:
            return
        self._run_order(chosen)
        self._grad_average = None  # its buckets follow the order of each stage's last backward

    def step_with_timeline(self, x: Any, target: Any, loss_fn: LossFn, scaler=None):
        """Like ``step``, and also returns the step's measured timeline.

        Returns:
            ``(loss, simulation)``: the simulation holds every rank's real action
            times in milliseconds (distributed mode gathers them to every rank),
            its measured bubble ratio, and ``to_chrome_trace`` / ``plot``.
        """
        from fastpipe.runtime.timeline import measured

        self._recording, lowered = [], self._lowered  # the order this step runs in
        try:
            loss = self.step(x, target, loss_fn, scaler)
            records = self._recording
        finally:
            self._recording = None
        if self.distributed:
            self._runner.finish_loss_broadcast()
            gathered: list = [None] * self.schedule.ranks
            dist.all_gather_object(gathered, records, group=self.group)
            records = [r for part in gathered for r in part]
        return loss, measured(lowered, records)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The entries of the stages this process holds (every stage in local
        mode), under the names ``model.state_dict()`` gives them, buffers
        included; a tensor several layers share is listed once, under its
        first name in the whole model (``fastpipe._state``).

        Saved by every rank with ``torch.distributed.checkpoint``, one
        checkpoint of the whole model: it loads into the plain model or a
        Pipe of another layout (``docs/design/pipe.md``, "checkpoints").
        """
        if args:
            raise TypeError("Pipe.state_dict takes keyword arguments only "
                            "(destination=, prefix=, keep_vars=)")
        from fastpipe._state import held_state_dict

        return held_state_dict(self.module, self._place.held_layers(), destination, prefix, keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads the entries of the stages this process holds from
        ``state_dict``: this rank's (as ``state_dict()`` gives them) or the
        whole model's (entries of other ranks' stages are skipped). A shared
        tensor may come under any of its names.

        Returns:
            ``(missing_keys, unexpected_keys)`` as ``nn.Module.load_state_dict``.

        Raises:
            RuntimeError: ``strict`` and an entry of this rank's stages is
                missing, or a key names nothing in the model; or a shape
                differs.
            ValueError: ``assign`` and a tensor of this rank's stages is
                held in two places (a tie), which a new object in one of
                them would untie.
        """
        from fastpipe._state import load_held

        result = load_held(self.module, self._place.held_layers(), state_dict, strict, assign)
        # Compared again before the next step.
        self._weights_checked = not self.distributed and not self._place.fresh
        self._written_checked = self._weights_checked
        return result

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The parameters of the stages this process holds (every one in
        local mode), under the model's names: what this rank's optimizer
        steps and checkpoints (build it over ``pipe.parameters()``). With
        ``balance="auto"`` in distributed mode the split is made at the first
        step; before it, every parameter of the model."""
        yield from self._place.held(self.module.named_parameters(prefix, recurse, remove_duplicate))

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The buffers of the stages this process holds, as ``named_parameters``."""
        yield from self._place.held(self.module.named_buffers(prefix, recurse, remove_duplicate))

    def _fqn_modifiers(self) -> dict[str, str]:
        # torch.distributed.checkpoint.state_dict names entries by walking the
        # modules: the model's layers are reached through self.module, which
        # the names (as state_dict and named_parameters give them) leave out.
        return {name: "module" for name in self.module._modules}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the whole pipeline.

        In distributed mode each rank holds only its stages' gradients, so
        torch's function called there would clip each rank by its own norm.
        This one combines every rank's part over the group (a parameter tied
        across ranks counts once) and scales each rank's gradients by the one
        total, as torch would for the unsplit model; call it on every rank,
        after ``step``. In local mode it is torch's function over the
        model's parameters, whatever devices they are on.

        Returns:
            The total norm of the gradients before clipping (on every rank).

        Raises:
            RuntimeError: the norm is non-finite and ``error_if_nonfinite``
                (on every rank, before any gradient changes).
        """
        from fastpipe._grad_norm import clip_grad_norm

        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
            raise TypeError(f"norm_type must be a number, got {type(norm_type).__name__}")
        self._check_not_broken()
        if self._stages is None:
            raise RuntimeError("clip_grad_norm_ needs the stages: with balance='auto' call step first")
        scaled = self._place.held_parameters()
        if not self.distributed:
            return clip_grad_norm(scaled, scaled, max_norm, norm_type, error_if_nonfinite, foreach,
                                  None, None)
        # A tied parameter is held by each rank that uses it: the first one counts it.
        elsewhere = {id(t.param) for t in self._place.ties if t.ranks[0] != self.rank}
        counted = [p for p in scaled if id(p) not in elsewhere]
        self._runner.finish_loss_broadcast()
        return clip_grad_norm(counted, scaled, max_norm, norm_type, error_if_nonfinite, foreach,
                              self.group, self.devices[self.rank])

    def forward(self, x: Any) -> Any:
        """Inference: ``model(x)`` computed microbatch by microbatch, without autograd.

        Under grad mode the output requires grad, as a module's would, but a
        backward through it raises a RuntimeError that points to ``step``,
        which is how a Pipe trains.

        Returns:
            The output (concatenated along dim 0) on the rank of the last stage;
            ``None`` on other ranks in distributed mode.
        """
        self._check_not_broken()
        if self._stages is None:
            self._split_by_time(x)
        if not self._written_checked:
            self._place.check_written()
            self._written_checked = True
        inputs, _, refused = self._split_inputs(x, None)
        results = self._run(self._forward_only, inputs, None, None, train=False, refuse=refused)
        if not results:
            return None
        out = mbatch.gather([results[mb] for mb in range(self.chunks)])
        trained = next((p for p in self.module.parameters() if p.requires_grad and not p.is_meta),
                       None)
        if torch.is_grad_enabled() and trained is not None:
            out = no_backward(out, trained)
        return out

    def __reduce_ex__(self, protocol):
        # copy.deepcopy and pickle land here: a copy would share or lose the
        # worker lanes, buffer rings and process groups the stages run on.
        raise TypeError("a Pipe cannot be copied or pickled: copy the model (or save its "
                        "state_dict) and wrap the copy in a new Pipe")

    def _check_not_broken(self) -> None:
        broken = getattr(self._runner, "broken", None)
        if broken is not None:
            raise RuntimeError(
                f"an earlier step of this Pipe failed on rank {self.rank} ({broken!r}); its "
                "process group may still hold that step's messages, so the pipeline cannot go "
                "on: destroy the process group and build it and the Pipe again"
            ) from broken

    def _split_inputs(self, x: Any, target: Any):
        """(input microbatches, target microbatches, None) for the stages this
        process holds. Inputs it cannot split raise here in local mode; in
        distributed mode the error comes back third, for ``_run`` to fail
        the step with on every rank."""
        try:
            changed = changed_layer(tuple(self.module), self._place.layers)
            if changed is not None:
                raise ValueError(changed)
            return (*self._split(x, target), None)
        except (TypeError, ValueError) as exc:
            if not self.distributed:
                raise
            return None, None, exc

    def _split(self, x: Any, target: Any):
        owners = self.schedule.stage_to_rank
        holds_first = not self.distributed or self.rank == owners[0]
        holds_last = not self.distributed or self.rank == owners[-1]
        first, last = self.devices[owners[0]], self.devices[owners[-1]]
        inputs = _args.named_split("x", mbatch.to_device(x, first), self.chunks) if holds_first else None
        targets = None
        if target is not None and holds_last:
            targets = _args.named_split("target", mbatch.to_device(target, last), self.chunks)
            if holds_first and mbatch.batch_size(target) != mbatch.batch_size(x):
                raise ValueError(
                    f"x and target have different batch sizes: {mbatch.batch_size(x)} and "
                    f"{mbatch.batch_size(target)}"
                )
        return inputs, targets

    def _run(self, schedule: Schedule, inputs, targets, loss_fn, train: bool,
             refuse: BaseException | None = None) -> dict[int, Any]:
        if self.distributed:
            average = self._grad_average if train else None
            return self._runner.run(schedule, self._stages[self.rank], inputs, targets, loss_fn, train,
                                    refuse, self._recording,
                                    average.stage_done if average is not None else None)
        ties = self._place.local_ties
        if ties is None:
            return self._runner.run(schedule, self._stages, inputs, targets, loss_fn, train,
                                    self._recording)
        with ties.swapped():  # replicas of parameters tied across ranks, for this call
            results = self._runner.run(schedule, self._stages, inputs, targets, loss_fn, train,
                                       self._recording)
            if train:
                ties.gather()
            return results

    def _mean_loss(self, results: dict[int, torch.Tensor]) -> torch.Tensor:
        if not self.distributed:
            return torch.stack([results[mb] for mb in range(self.chunks)]).mean()
        return self._runner.mean_loss(results, self.chunks)

    def close(self) -> None:
        """Stops the pipe's lanes of the native ring (also done at interpreter exit)
        and gives its CUDA streams back to the process's pool, which keeps them:
        torch may still refer to them (``runtime/streams.py``). A later step
        makes both afresh."""
        self._runner.close()

    def compile(self, *args, **kwargs):
        """Refused: ``nn.Module.compile`` would compile ``pipe(x)``'s call only,
        never ``step``. Compile the layers before wrapping them."""
        raise NotImplementedError(
            "Pipe.compile() would compile only pipe(x), not step: compile the model's layers (or "
            "blocks) before wrapping it, e.g. model[i] = torch.compile(model[i]); "
            "Pipe(model, ...) then runs them compiled")

    def extra_repr(self) -> str:
        return (f"schedule={self.schedule.name!r}, chunks={self.chunks}, balance={self.balance}, "
                f"checkpoint={self.checkpoint!r}")
