"""``Pipe``: the ``nn.Sequential`` drop-in that trains with a pipeline schedule."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpipe import _microbatch as mbatch
from fastpipe._ties import LocalTies, TiedGrads, check_local, find_ties
from fastpipe.balance import balance_by_params
from fastpipe.runtime.checkpoint import check_mode, stochastic
from fastpipe.runtime.executor import LossFn, RankExecutor, Stage, last_backward
from fastpipe.runtime.packing import check_wire
from fastpipe.runtime.buffers import copy_slots
from fastpipe.runtime.lanes import lanes_for
from fastpipe.runtime.threads import autocast_state, switch_interval, with_caller_threads
from fastpipe.runtime.transport import (
    CommLanes, CopyTransport, DistTransport, LocalTransport, Mailbox, ReceiveRings, connect_pairs,
    flow_groups, late_groups,
)
from fastpipe.schedules import Action, Kind, Schedule, build, lower

log = logging.getLogger(__name__)

DeviceLike = str | int | torch.device
_LOSS_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


class Pipe(nn.Module):
    """Pipeline-parallel wrapper of an ``nn.Sequential``.

    The model's children are split into ``ranks × stages_per_rank`` stages of
    contiguous layers and run by a schedule over ``chunks`` microbatches.

    * **Local mode** (``torch.distributed`` not initialized): each pipeline
      rank is a lane of fastpipe's native ring in this process, on its own
      entry of ``devices``; ``devices=["cpu", "cpu"]`` is a real two-rank
      pipeline.
    * **Distributed mode** (a process group is initialized, e.g. by torchrun):
      one pipeline rank per process; each process runs only its own stages and
      exchanges activations and gradients with isend/irecv. All ranks pass the
      same arguments; inputs are read on the rank of the first stage, targets
      on the rank of the last (others may pass ``None``).

    The user's layer objects are kept, not copied: an optimizer built on
    ``model.parameters()`` keeps working. In local mode each stage's layers
    are moved to its device. In distributed mode every rank keeps the whole
    model unless ``free_remote=True`` releases the other ranks' layers.

    Gradient semantics: after ``step(x, target, loss_fn)`` every parameter of
    a stage held by this process has, accumulated into its ``.grad`` like a
    normal backward, the gradient of the mean over microbatches of
    ``loss_fn(model(x_mb), target_mb)``; parameters of other ranks' stages get
    none. ``step`` returns that mean loss, detached, on every rank. Equal up
    to float rounding: stages of Linears and activations ("chains",
    ``fastpipe.runtime.chain``) sum the weight gradients of microbatches with
    few rows inside one GEMM, as the unsplit batch would, where autograd adds
    one microbatch at a time (``FASTPIPE_CHAIN_GATHER=0`` adds them one at a
    time too).

    Args:
        model: the ``nn.Sequential`` to split.
        chunks: microbatches per step; the batch is split along dim 0 into
            exactly this many parts (sizes differ by at most one).
        schedule: a name from ``fastpipe.schedules.names()`` or a ``Schedule``.
        balance: layers per stage, e.g. ``[3, 5]``; None balances parameter counts.
        devices: local mode: one device per pipeline rank. Distributed mode:
            optional, one per rank (default: CPU for gloo, the current CUDA
            device for NCCL).
        stages_per_rank: virtual stages per rank (interleaved, looped, V schedules).
        group: the process group (default: the world, when initialized). On
            gloo the Pipe also makes (once per group, collectively over its
            ranks only) two groups of its own for the messages that go up
            and down the ranks; see ``transport.flow_groups`` for why.
        mesh: instead of ``group``, a ``torch.distributed.device_mesh.DeviceMesh``
            with dimensions ``("dp", "pp")`` (or ``("pp",)``): the pipeline
            runs over this process's ``pp`` ranks, and each ``dp`` replica
            passes its own shard of the batch. After ``step`` the gradients
            of every rank's parameters are averaged over ``dp`` (bucketed
            all-reduce) and ``step`` returns the mean loss over the replicas,
            so each replica holds the gradient of the global batch's mean
            loss; ``clip_grad_norm_`` then clips by the global norm.
            Replicas must start from equal weights: the first ``step``
            refuses (ValueError on every rank) if they differ
            (``fastpipe._data_parallel``).
        timeout: seconds a rank waits for a peer (or for a free buffer slot)
            before raising TimeoutError.
        overlap: run communication on lanes of fastpipe's native ring (send,
            send completion, receive posting, receive completion; in local
            mode on GPUs, each rank's copy stream), so compute never waits for
            a send. ``False`` runs transfers on the compute thread (on GPUs,
            the compute stream): sends when the schedule says, receives
            posted ahead from a window as buffer slots free up. ``None``
            (default): lanes when the pipeline's devices are not CPUs; on CPUs
            the thread hand-offs cost more than they hide (``python -m bench
            pipelining`` measures both). On NCCL transfers are always issued
            inline from the rank's compute stream (NCCL's own streams overlap
            them), and ``True`` is refused.
        checkpoint: ``"never"`` (default), ``"except_last"`` or ``"always"``:
            which microbatches forget their stage activations in forward and
            recompute them in backward (torchgpipe's modes; the last
            microbatch's backward follows its forward, so recomputing it
            saves little). Gradients are unchanged, dropout included: the
            recomputation replays the forward's random state. A layer can
            call ``fastpipe.is_recomputing()`` to skip side effects.
        recompute: ``"none"`` (default) or ``"selective"``: apply
            ``fastpipe.selective_recompute`` to the model (in place) so
            activations feeding a Linear, dropout masks and norm outputs are
            recomputed in backward instead of stored.
        wire_dtype: activations cross rank boundaries in this dtype
            (``torch.bfloat16``, ``torch.float16`` or ``torch.float8_e4m3fn``):
            floating tensors wider than it are rounded to nearest even on the
            way out and cast back on arrival, so slow links carry fewer bytes.
            Integer and bool tensors are never cast. None (default) sends
            exact values.
        grad_wire_dtype: the same for the gradients sent back (kept separate:
            gradients are more sensitive to rounding).
        plan: a ``fastpipe.plan(...)`` result: its chunks, schedule, balance,
            stages_per_rank and checkpoint mode are used (an explicit,
            non-default value that disagrees with the plan is an error).
        fused_wgrad: B (not only a zero-bubble schedule's W) runs the
            weight gradients of layers with a rule (``nn.Linear``,
            ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.Embedding``, registered
            ones) as deferred work (``fastpipe.runtime.deferred``): each
            Linear's accumulated straight into ``.grad`` with one ``addmm_``,
            gathered over microbatches while that holds less memory than the
            weight, instead of autograd's fresh gradient matrix plus an add.
            Gradients are the same up to float rounding. Off by default:
            it skips hooks registered on the parameters' AccumulateGrad nodes
            (``grad_fn`` level, e.g. DDP's); parameters with tensor hooks
            (``register_hook``, ``register_post_accumulate_grad_hook``) keep
            autograd's path.
        shm: distributed mode on one host: move messages through rings in
            shared memory instead of gloo's loopback sockets (each gloo
            message wakes two threads; on the 2-core benchmark machine the
            narrow pipeline's GPipe step went from 26.2 to 21.5 ms and its
            1F1B step from 25.8 to 22.2 ms). ``None`` (default):
            when the group is gloo, the devices CPUs, every rank on this host
            and ``overlap`` off; ``False`` (or ``FASTPIPE_SHM=0``): always
            torch.distributed's P2P; ``True``: required (ValueError saying
            why not). ``pipe.shm`` tells which was taken. The group still
            carries the set-up, the loss broadcast and barriers. See
            ``fastpipe/runtime/shm.py``.
        free_remote: distributed mode: once the pipeline is set up, the
            parameters and buffers of the layers other ranks hold are
            replaced in their modules by meta tensors of the same shape and
            dtype, so each process keeps the weights of its own stages only
            (every rank builds the whole model first; with it, a rank then
            holds about 1/ranks of the weights). Their data is freed once
            nothing else refers to it: build the optimizer after the Pipe,
            over ``pipe.parameters()`` (one built before still holds the old
            tensors, harmlessly: they get no gradient). ``model.state_dict()``
            then has meta tensors for those layers; ``pipe.state_dict()``
            has this rank's own. Default False:
            every rank keeps the whole model, as built. Layers a Pipe must
            run that hold meta tensors are refused (ValueError on every rank).

    Checkpoints: ``pipe.state_dict()`` holds the stages this process runs,
    under the model's names; ``pipe.parameters()`` are theirs (build a
    distributed rank's optimizer over them), so
    ``torch.distributed.checkpoint``'s ``get_state_dict(pipe, optimizer)``
    and ``set_state_dict`` save and load a pipeline by name, across
    schedules and numbers of ranks (``fastpipe._state``).

    ``balance="auto"`` balances measured layer times (``balance_by_time``;
    by simulating the schedule where a rank runs several stages) on
    the first microbatch of the first ``step``: the model is split then, on
    the rank holding the input in distributed mode, and shared with the others.

    A parameter used by layers of several stages (a tied embedding, a module
    at two depths) gets the unsplit model's gradient, the sum of every use's:
    stages of one rank share it as they are; across ranks, distributed mode
    sums each rank's share over the group after every ``step`` (one
    ``all_reduce`` per dtype), so each rank that uses it holds the whole
    gradient and, stepping its optimizer like the others, keeps its copy
    equal to theirs. In local mode the other ranks run it on a replica on
    their own device, copied in for each call and its gradient added to the
    parameter's after each ``step`` (the ranks are threads: none adds into
    another's ``.grad``); one module run by stages of two ranks is refused.

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
        fused_wgrad: bool = False,
        shm: bool | None = None,
        free_remote: bool = False,
    ) -> None:
        super().__init__()
        _check_model(model)
        if shm is not None and not isinstance(shm, bool):
            raise TypeError(f"shm must be a bool or None, got {type(shm).__name__} ({shm!r})")
        if not isinstance(fused_wgrad, bool):
            raise TypeError(f"fused_wgrad must be a bool, got {type(fused_wgrad).__name__} "
                            f"({fused_wgrad!r})")
        self.fused_wgrad = fused_wgrad
        if not isinstance(free_remote, bool):
            raise TypeError(f"free_remote must be a bool, got {type(free_remote).__name__} "
                            f"({free_remote!r})")
        self.free_remote = free_remote
        if plan is not None:
            chunks, schedule, balance, stages_per_rank, checkpoint = _from_plan(
                plan, chunks, schedule, balance, stages_per_rank, checkpoint
            )
        _check_chunks(chunks)
        self.module = model
        self.chunks = chunks
        self.timeout = _check_timeout(timeout)
        if overlap is not None and not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool or None, got {type(overlap).__name__} ({overlap!r})")
        self.checkpoint = check_mode(checkpoint)
        if recompute not in ("none", "selective"):
            raise ValueError(f"recompute must be 'none' or 'selective', got {recompute!r}")
        self.recompute = recompute
        check_wire(wire_dtype)
        check_wire(grad_wire_dtype)
        self._wire = {"F": wire_dtype, "B": grad_wire_dtype}
        self.dp_group = None  # the data-parallel group of a ("dp", "pp") mesh
        if mesh is not None:
            if group is not None:
                raise ValueError("pass group= or mesh=, not both: the mesh's 'pp' dimension is the group")
            group, self.dp_group = _mesh_groups(mesh)
        self.distributed = group is not None or (dist.is_available() and dist.is_initialized())
        self.group = group
        ranks = dist.get_world_size(group) if self.distributed else None
        self.devices = _resolve_devices(devices, ranks, self.distributed, group)
        ranks = len(self.devices) if ranks is None else ranks
        self._nccl = self.distributed and dist.get_backend(group) == "nccl"
        # Exact messages: NCCL's rules (sizes equal, matched by order, not tag).
        # FASTPIPE_EXACT_MESSAGES=1 applies them on gloo, which is how they are tested.
        self._exact_messages = self.distributed and (
            self._nccl or os.environ.get("FASTPIPE_EXACT_MESSAGES") == "1")
        if self._exact_messages and overlap:
            raise ValueError(
                "overlap=True is not supported on NCCL: its P2P already runs on NCCL's own streams, "
                "and fastpipe issues it from the rank's compute stream (leave overlap=None)"
            )
        self.overlap = (overlap if overlap is not None
                        else not self._exact_messages and any(d.type != "cpu" for d in self.devices))
        self.schedule = _resolve_schedule(schedule, ranks, chunks, stages_per_rank)
        self.rank = dist.get_rank(group) if self.distributed else None
        self._lowered = lower(self.schedule)
        self._forward_only = lower(_forward_schedule(self.schedule))
        self._memory: dict[int, int] = {}  # rank -> peak saved-activation bytes of the last step
        self._input_grads: dict[int, list[torch.Tensor]] = {}  # stage 0 input grads of a step
        if isinstance(balance, str) and balance != "auto":
            raise ValueError(f"balance must be a list of ints, None or 'auto', got {balance!r}")
        auto = balance == "auto"  # split at the first step, by measured time
        resolved = _resolve_balance(None if auto else balance, model, self.schedule.stages)
        self._ties: list = []  # parameters used by several stages (fastpipe._ties)
        self._tied = None  # distributed: TiedGrads, when some tie spans ranks
        self._local_ties = None  # local mode: LocalTies, when some tie spans ranks
        if not auto:
            self._find_ties(model, resolved)
        if recompute == "selective":  # changes the user's model in place: after every check
            from fastpipe.kernels import selective_recompute

            selective_recompute(model)
        self.balance = None if auto else resolved
        self._problem: str | None = None  # set by _build_stages; raised on every rank
        self._stages = None if auto else self._build_stages()
        self._ring = None
        # Local mode on GPUs: transfers are copies on each rank's copy lane into
        # receive slots (CopyTransport); on CPUs tensors are handed over as they
        # are, and a pipeline mixing CPUs and GPUs uses blocking .to() copies.
        # (_copies=True forces the copy path on CPUs, with host lanes: tests.)
        self._copies = not self.distributed and all(d.type == "cuda" for d in self.devices)
        self._device_lanes: dict[int, Any] = {}  # rank -> CudaLanes, made once (until close())
        # GIL switch interval during a local step with several ranks; None
        # leaves the interpreter's own (runtime/threads.py: measured, no clear gain).
        self._switch_interval: float | None = None
        self._recv_rings: ReceiveRings | None = None
        self._broken: BaseException | None = None  # distributed: the failure that ended a step
        # The last stage's rank: the loss broadcast of the last step, still
        # in flight (Work, tensor), waited for before the next collective.
        self._loss_broadcast: tuple | None = None
        if shm is None and os.environ.get("FASTPIPE_SHM", "1") == "0":
            shm = False
        if shm and not self.distributed:
            raise ValueError("shm=True applies to distributed mode (ranks in separate processes); "
                             "local-mode ranks share one process and hand tensors over directly")
        if free_remote and not self.distributed:
            raise ValueError("free_remote=True applies to distributed mode: in local mode every "
                             "stage runs in this process, so no layer is held elsewhere")
        if self.distributed:
            self._check_ranks_agree(balance, recompute, shm)
        elif self._problem is not None:
            raise ValueError(self._problem)
        self._shm = self._connect_shm(shm) if self.distributed else None
        self.shm = self._shm is not None
        # Messages up and down the ranks on separate groups (see flow_groups).
        split = self.distributed and not self.shm and dist.get_backend(group) in ("gloo", "nccl")
        self._p2p_groups = flow_groups(group) if split else {}
        self._late_groups = late_groups(group) if self._exact_messages else {}
        if self._exact_messages:  # NCCL's pair communicators, each made before any step
            connect_pairs([*(self._p2p_groups.values() or [group]), *self._late_groups.values()], group,
                          self.schedule.stage_to_rank, self.rank, self.devices[self.rank])
        self._dist_transport = None  # DistTransport or ShmTransport, made at the first step
        self._grad_average = None  # GradAverage over dp_group, made with the stages
        # Replicas and tied copies are compared before the first step (and after a load).
        self._weights_checked = not self.distributed
        self._recording: list | None = None  # set by step_with_timeline
        if self._stages is not None and free_remote:  # last: nothing above may fail after it
            self._free_remote_layers()
        log.info("pipe: %s, %d ranks, balance %s", self.schedule.name, ranks, self.balance)

    # --- set-up ----------------------------------------------------------------

    def _split_by_time(self, x: Any) -> None:
        """balance="auto": profile on the first microbatch, then build the stages."""
        from fastpipe.balance import balance_by_time

        balance = None
        holder = self._owner(0)
        # The holder profiles every layer: it must hold them all (every rank raises, or none).
        profiles = not self.distributed or self.rank == holder
        mine = _meta_problem(list(self.module), range(len(self.module))) if profiles else None
        if self.distributed:
            everyone: list = [None] * self.schedule.ranks
            dist.all_gather_object(everyone, mine, group=self.group)
            _raise_first(everyone)
        elif mine is not None:
            raise ValueError(mine)
        if profiles:
            balance = balance_by_time(self.schedule.stages, self.module, x, self.chunks,
                                      self.devices[holder], schedule=self.schedule)
        if self.distributed:
            box = [balance]
            src = dist.get_global_rank(self.group, holder) if self.group is not None else holder
            dist.broadcast_object_list(box, src=src, group=self.group)
            if self.dp_group is not None:  # every replica takes the first one's split
                dist.broadcast_object_list(box, src=dist.get_global_rank(self.dp_group, 0),
                                           group=self.dp_group)
            balance = box[0]
        self.balance = _resolve_balance(balance, self.module, self.schedule.stages)
        self._find_ties(self.module, self.balance)
        self._stages = self._build_stages()
        if self.distributed:  # every rank raises, or none
            everyone: list = [None] * self.schedule.ranks
            dist.all_gather_object(everyone, self._problem, group=self.group)
            _raise_first(everyone)
        elif self._problem is not None:
            raise ValueError(self._problem)
        if self.free_remote:
            self._free_remote_layers()
        log.info("pipe: balance by time %s", self.balance)

    def _connect_shm(self, shm: bool | None):
        """The shared-memory rings of a same-host CPU pipeline (``runtime/shm.py``), or None."""
        if shm is False:
            return None
        if self._nccl:
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
        elif self._exact_messages:
            why_not = "exact messages are on (FASTPIPE_EXACT_MESSAGES=1)"
        elif self.overlap:
            why_not = "overlap=True runs transfers on lanes; shared memory runs them inline"
        peers = neighbours(self.schedule.stage_to_rank, self.rank)
        return connect(self.group, self.rank, self.schedule.ranks, peers, why_not, required=shm is True)

    def _check_ranks_agree(self, balance, recompute: str, shm: bool | None = None) -> None:
        """One small collective: every rank must have built the same pipeline.

        Raises (on every rank):
            ValueError: naming the first setting that differs and each rank's value.
        """
        mine = {
            "layers": len(self.module), "chunks": self.chunks, "schedule": self.schedule.name,
            "stages": self.schedule.stages, "placement": tuple(self.schedule.stage_to_rank),
            "balance": "auto" if self.balance is None else tuple(self.balance),
            "checkpoint": self.checkpoint, "recompute": recompute,
            "wire_dtype": str(self._wire["F"]), "grad_wire_dtype": str(self._wire["B"]),
            "exact messages": self._exact_messages,  # tags or order: both ends must agree
            "shm": shm,  # the rings are set up collectively: every rank must take part
            # Summed after every step by all ranks together (fastpipe._ties).
            "tied parameters": tuple((t.name, t.stages) for t in self._ties),
        }
        for group, who in ((self.group, "pipeline ranks"), (self.dp_group, "data-parallel replicas")):
            if group is None and who != "pipeline ranks":
                continue
            everyone: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, (mine, self._problem), group=group)
            _raise_first([problem for _, problem in everyone])
            everyone = [theirs for theirs, _ in everyone]
            for name in mine:
                values = [theirs[name] for theirs in everyone]
                if any(v != values[0] for v in values):
                    listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
                    raise ValueError(f"{who} disagree on {name} ({listed}); every rank must "
                                     "build the Pipe with the same arguments")

    def memory_stats(self) -> dict[int, dict[str, int]]:
        """Bytes per pipeline rank held by this process, as the executor accounts them.

        Returns:
            ``{rank: {"params", "grads", "activations_peak", "peak"}}``:
            parameter and current gradient bytes of the rank's stages, the
            most saved-activation bytes alive at once during the last step
            (autograd's saved tensors, parameters excluded, counted as they
            are saved and freed microbatch by microbatch), and their sum.
        """
        out = {}
        for rank in self._local_ranks():
            # Once each: stages of one rank may share a parameter.
            params = list({id(p): p for st in (self._stages or {}).get(rank, {}).values()
                           for p in st.module.parameters()}.values())
            p_bytes = sum(p.numel() * p.element_size() for p in params)
            g_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
            act = self._memory.get(rank, 0)
            out[rank] = {"params": p_bytes, "grads": g_bytes, "activations_peak": act,
                         "peak": p_bytes + g_bytes + act}
        return out

    def _local_ranks(self) -> list[int]:
        return list(range(self.schedule.ranks)) if not self.distributed else [self.rank]

    def _layer_ranges(self) -> list[range]:
        """The model's layer indices of each stage."""
        return _ranges(self.balance)

    def _find_ties(self, model: nn.Sequential, balance: list[int]) -> None:
        """Parameters that layers of several stages use (``fastpipe._ties``):
        in local mode checked here (one module run by two ranks is refused)
        and given replicas with the stages; in distributed mode summed
        across ranks after each step."""
        self._ties = find_ties(model, _ranges(balance), self.schedule.stage_to_rank)
        if not self.distributed:
            check_local(self._ties, model, _ranges(balance), self.schedule.stage_to_rank)
            return
        across = [t for t in self._ties if len(t.ranks) > 1]
        tied = TiedGrads(across, self.rank, self.devices[self.rank], self.group)
        self._tied = tied if tied else None

    def _build_stages(self) -> dict[int, dict[int, Stage]]:
        """This process's stages, on their devices. A layer holding meta
        tensors (no data: released by an earlier ``free_remote`` Pipe, or
        never materialized) is not moved; ``self._problem`` says which, for
        the caller to raise on every rank."""
        layers = list(self.module)
        ranges = self._layer_ranges()
        self._problem = None
        stages: dict[int, dict[int, Stage]] = {}
        for rank in self._local_ranks():
            device = self.devices[rank]
            held = {}
            for s in range(self.schedule.stages):
                if self.schedule.stage_to_rank[s] != rank:
                    continue
                problem = _meta_problem(layers, ranges[s])
                if problem is not None:
                    self._problem = problem
                    continue
                part = nn.Sequential(*(layers[i] for i in ranges[s])).to(device)
                held[s] = Stage(s, part, device)
            stages[rank] = held
        self._layers = tuple(layers)  # what the stages hold: see _check_layers
        across = [t for t in self._ties if len(t.ranks) > 1]
        if not self.distributed and across and self._problem is None:
            self._local_ties = LocalTies(across, stages, self.devices)
        return stages

    def _check_layers(self) -> None:
        """The stages hold the layers the model had when they were built: a
        layer replaced, added or removed since would silently not train."""
        now = tuple(self.module)
        if now != self._layers:
            changed = next((i for i, (a, b) in enumerate(zip(now, self._layers)) if a is not b),
                           min(len(now), len(self._layers)))
            raise ValueError(
                f"the model's layers changed after the Pipe was built (layer {changed} of "
                f"{len(self._layers)}, now {len(now)} layers): build a new Pipe over the model")

    def _free_remote_layers(self) -> None:
        """free_remote: the layers of other ranks' stages keep their
        parameters' and buffers' shapes and dtypes on the meta device, and
        their data is freed (once nothing else holds it). A tensor that a
        local stage uses too (a tied parameter, a module used twice) stays."""
        layers = list(self.module)
        ranges = self._layer_ranges()
        mine = [s for s in range(self.schedule.stages) if self.schedule.stage_to_rank[s] == self.rank]
        keep = {id(t) for s in mine for i in ranges[s]
                for t in itertools.chain(layers[i].parameters(), layers[i].buffers())}
        for s, layer_range in enumerate(ranges):
            if s not in mine:
                for i in layer_range:
                    _to_meta(layers[i], keep)

    def _lanes(self) -> int:
        """Lanes of the native ring this pipe uses (created on first use)."""
        if self.distributed:
            return 4 if self.overlap else 1
        return 2 * self.schedule.ranks if self.overlap or self._copies else self.schedule.ranks

    def _ring_for(self):
        from fastpipe._ext import native

        if self._ring is None:
            self._ring = native().HostRing(self._lanes())
        return self._ring

    def _transport(self, rank: int, mailbox: Mailbox | None):
        if self._shm is not None:
            if self._dist_transport is None:
                from fastpipe.runtime.shm import ShmTransport

                link, writers, readers = self._shm
                self._dist_transport = ShmTransport(link, writers, readers, self.devices[rank],
                                                    self.schedule.stages, self.timeout, self._wire)
            return self._dist_transport
        if self.distributed:
            lanes = CommLanes(self._ring_for(), 0, 1, 2, 3) if self.overlap else None
            if self._dist_transport is not None:  # kept: both ends learnt the same sizes
                self._dist_transport.lanes = lanes  # the ring is new after close()
            else:
                self._dist_transport = DistTransport(
                    self.group, self.devices[rank], self.schedule.stages, self.timeout, lanes,
                    self._wire, stage_to_rank=tuple(self.schedule.stage_to_rank),
                    groups=self._p2p_groups, exact=self._exact_messages, late=self._late_groups,
                    rank=rank,
                    # NCCL sends GPU memory; gloo's P2P takes host tensors.
                    buffers=self.devices[rank] if self._nccl else torch.device("cpu"),
                )
            return self._dist_transport
        # Local lanes: 0..ranks-1 run each rank's loop, ranks.. its sends.
        if self._copies:
            return CopyTransport(mailbox, rank, self.devices, self.timeout, self._lanes_of(rank),
                                 self._rings(), self._wire)
        lanes = CommLanes(self._ring, self.schedule.ranks + rank) if self.overlap else None
        return LocalTransport(mailbox, rank, self.devices, self.timeout, lanes, self._wire)

    def _lanes_of(self, rank: int):
        """The device lanes of a rank: its CUDA streams (made once), or host
        lanes on the current ring (local mode: lane ranks + rank runs its copies)."""
        lanes = self._device_lanes.get(rank)
        if lanes is None or getattr(lanes, "ring", self._ring) is not self._ring:
            lanes = lanes_for(self.devices[rank], self._ring, self.schedule.ranks + rank,
                              self.timeout, overlap=self.overlap)
            self._device_lanes[rank] = lanes
        return lanes

    def _drop_rings(self, lanes) -> None:
        """After a failed local step: slots of messages nobody took are still
        held, so the receive rings start afresh (once every lane is idle)."""
        if self._recv_rings is None:
            return
        for rank_lanes in lanes:
            rank_lanes.synchronize(rank_lanes.record())
        self._recv_rings = None

    def _rings(self) -> ReceiveRings:
        if self._recv_rings is None:
            # The worst case over every timing, of training and of inference.
            sizes = copy_slots(self._lowered.actions)
            for stream, n in copy_slots(self._forward_only.actions).items():
                sizes[stream] = max(n, sizes.get(stream, 0))
            self._recv_rings = ReceiveRings(sizes, self.timeout)
        return self._recv_rings

    # --- running -----------------------------------------------------------------

    def step(self, x: Any, target: Any, loss_fn: LossFn) -> torch.Tensor:
        """One training step: forward and backward of every microbatch.

        Inside ``torch.autocast(...)`` the forwards, the loss and any
        recomputation run under the caller's region and the backward outside
        it, as in the usual AMP loop, on every rank (local ranks are threads:
        they get the region from here).

        Returns:
            The mean over microbatches of ``loss_fn``, detached, on every rank.

        Raises:
            RuntimeError: called with gradients disabled (``torch.no_grad()``).
            ValueError / TypeError: inputs that cannot be split into ``chunks``.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("Pipe.step needs autograd; it was called inside torch.no_grad()")
        self._check_not_broken()
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if self._stages is None:
            self._split_by_time(x)
        if not self._weights_checked:
            self._check_weights()
        inputs, targets, refused = self._split_inputs(x, target)
        self._input_grads = {}
        tied = self._tied
        average = self._averager()
        averaging = False
        if tied is not None:
            tied.begin()  # .grad of parameters tied across ranks: this step's share only
        if average is not None:
            average.begin()
        try:
            try:
                results = self._run(self._lowered, inputs, targets, loss_fn, train=True,
                                    refuse=refused)
                grads = self._input_grads
            finally:
                self._input_grads = {}  # a failed step's are dropped
            loss = self._mean_loss(results)  # first: peers wait for it in distributed mode
            if grads:
                _backward_into_inputs(x, grads, self.chunks)
            if tied is not None:
                self._finish_loss_broadcast()
                tied.reduce()
            if average is not None:
                averaging = True
                self._finish_loss_broadcast()
                loss = average.average(loss)
        except BaseException as exc:
            if tied is not None:
                tied.restore()  # .grad as before the step, the step's share dropped
            if average is not None:
                if not averaging and isinstance(exc, Exception):
                    average.fail()  # the other replicas must not wait for this one's gradients
                self._broken = self._broken or exc  # replicas went out of step
            raise
        return loss

    def step_with_timeline(self, x: Any, target: Any, loss_fn: LossFn):
        """Like ``step``, and also returns the step's measured timeline.

        Returns:
            ``(loss, simulation)``: the simulation holds every rank's real action
            times in milliseconds (distributed mode gathers them to every rank),
            its measured bubble ratio, and ``to_chrome_trace`` / ``plot``.
        """
        from fastpipe.runtime.timeline import measured

        self._recording = []
        try:
            loss = self.step(x, target, loss_fn)
            records = self._recording
        finally:
            self._recording = None
        if self.distributed:
            self._finish_loss_broadcast()
            gathered: list = [None] * self.schedule.ranks
            dist.all_gather_object(gathered, records, group=self.group)
            records = [r for part in gathered for r in part]
        return loss, measured(self._lowered, records)

    def _averager(self):
        """The data-parallel averaging of this rank's gradients (made with the stages), or None."""
        if self.dp_group is None:
            return None
        if self._grad_average is None:
            from fastpipe._data_parallel import GradAverage

            stages = {i: list(st.module.parameters()) for i, st in self._stages[self.rank].items()}
            done = last_backward(self._lowered.actions[self.rank])
            late = {id(t.param) for t in self._tied.ties} if self._tied is not None else set()
            self._grad_average = GradAverage(stages, sorted(stages, key=done.__getitem__), late,
                                             self.dp_group, self.devices[self.rank])
        return self._grad_average

    def _check_weights(self) -> None:
        """Before the first step (and the first after a load): copies of one
        tensor on several ranks (a parameter tied across ranks; a rank's
        stages across data-parallel replicas) must hold the same values.
        Collective over the pipeline group and the dp group; every rank
        raises, or none.

        Raises:
            ValueError: naming the tensor and the ranks, and how to fix it.
        """
        from fastpipe._data_parallel import differing
        from fastpipe._state import held_state_dict

        device = self.devices[self.rank]
        problems = []
        if self._tied is not None:
            named = [(t.name, t.param if self.rank in t.ranks else None) for t in self._tied.ties]
            problems.append(differing(named, self.group, device, "pipeline ranks sharing a parameter"))
        if self.dp_group is not None:
            held = held_state_dict(self.module, self._held_layers(), keep_vars=True)
            named = [(n, t) for n, t in held.items() if isinstance(t, torch.Tensor)]
            problems.append(differing(named, self.dp_group, device, "data-parallel replicas"))
        problem = next((p for p in problems if p), None)
        for group in (self.group, self.dp_group):  # what one rank found, every rank raises
            if group is not None:
                everyone: list = [None] * dist.get_world_size(group)
                dist.all_gather_object(everyone, problem, group=group)
                problem = next((p for p in everyone if p), None)
        if problem is not None:
            raise ValueError(problem)
        self._weights_checked = True

    def _held_layers(self) -> list[int]:
        """The model's layer indices this process runs (every layer in local mode)."""
        if not self.distributed:
            return list(range(len(self.module)))
        if self._stages is None:
            raise RuntimeError("with balance='auto' the split is made at the first step: "
                               "call step (or forward) before state_dict or load_state_dict")
        ranges = self._layer_ranges()
        return [i for s in sorted(self._stages[self.rank]) for i in ranges[s]]

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The entries of the stages this process holds (every stage in local
        mode), under the names ``model.state_dict()`` gives them, buffers
        included; a tensor several layers share is listed once, under its
        first name in the whole model (``fastpipe._state``).

        Every rank of a distributed pipeline saving its own with
        ``torch.distributed.checkpoint.save`` writes one checkpoint of the
        whole model: it loads into the plain model
        (``fastpipe.state_dict(model)`` are the keys to load) or into a
        Pipe of another schedule or number of ranks. For optimizer state
        use ``torch.distributed.checkpoint.state_dict.get_state_dict(pipe,
        optimizer)`` and ``set_state_dict``, which call these.
        """
        if args:
            raise TypeError("Pipe.state_dict takes keyword arguments only "
                            "(destination=, prefix=, keep_vars=)")
        from fastpipe._state import held_state_dict

        return held_state_dict(self.module, self._held_layers(), destination, prefix, keep_vars)

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
        """
        from fastpipe._state import load_held

        result = load_held(self.module, self._held_layers(), state_dict, strict, assign)
        self._weights_checked = not self.distributed  # compared again before the next step
        return result

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The parameters of the stages this process holds (every one in
        local mode), under the model's names: what this rank's optimizer
        steps and checkpoints (build it over ``pipe.parameters()``). With
        ``balance="auto"`` in distributed mode the split is made at the first
        step; before it, every parameter of the model."""
        yield from self._held(self.module.named_parameters(prefix, recurse, remove_duplicate))

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The buffers of the stages this process holds, as ``named_parameters``."""
        yield from self._held(self.module.named_buffers(prefix, recurse, remove_duplicate))

    def _held(self, named):
        if not self.distributed or self._stages is None:
            yield from named
            return
        held = {id(t) for st in self._stages[self.rank].values()
                for t in itertools.chain(st.module.parameters(), st.module.buffers())}
        yield from ((name, t) for name, t in named if id(t) in held)

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
        held = {id(p): p for st in self._stages.get(self.rank, {}).values()
                for p in st.module.parameters()} if self.distributed else \
            {id(p): p for p in self.module.parameters()}
        scaled = list(held.values())
        if not self.distributed:
            return clip_grad_norm(scaled, scaled, max_norm, norm_type, error_if_nonfinite, foreach,
                                  None, None)
        # A tied parameter is held by each rank that uses it: the first one counts it.
        elsewhere = {id(t.param) for t in self._ties if t.ranks[0] != self.rank}
        counted = [p for p in scaled if id(p) not in elsewhere]
        self._finish_loss_broadcast()
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
        inputs, _, refused = self._split_inputs(x, None)
        results = self._run(self._forward_only, inputs, None, None, train=False, refuse=refused)
        if not results:
            return None
        out = mbatch.gather([results[mb] for mb in range(self.chunks)])
        trained = next((p for p in self.module.parameters() if p.requires_grad and not p.is_meta),
                       None)
        if torch.is_grad_enabled() and trained is not None:
            out = _no_backward(out, trained)
        return out

    def _owner(self, stage: int) -> int:
        return self.schedule.stage_to_rank[stage]

    def __reduce_ex__(self, protocol):
        # copy.deepcopy and pickle land here: a copy would share or lose the
        # worker lanes, buffer rings and process groups the stages run on.
        raise TypeError("a Pipe cannot be copied or pickled: copy the model (or save its "
                        "state_dict) and wrap the copy in a new Pipe")

    def _check_not_broken(self) -> None:
        if self._broken is not None:
            raise RuntimeError(
                f"an earlier step of this Pipe failed on rank {self.rank} ({self._broken!r}); its "
                "process group may still hold that step's messages, so the pipeline cannot go "
                "on: destroy the process group and build it and the Pipe again"
            ) from self._broken

    def _split_inputs(self, x: Any, target: Any):
        """(input microbatches, target microbatches, None) for the stages this
        process holds. Inputs it cannot split raise here in local mode; in
        distributed mode the error comes back third, for ``_run`` to fail
        the step with on every rank."""
        try:
            self._check_layers()
            return (*self._split(x, target), None)
        except (TypeError, ValueError) as exc:
            if not self.distributed:
                raise
            return None, None, exc

    def _split(self, x: Any, target: Any):
        holds_first = not self.distributed or self.rank == self._owner(0)
        holds_last = not self.distributed or self.rank == self._owner(self.schedule.stages - 1)
        inputs = _named_split("x", x, self.chunks) if holds_first else None
        targets = None
        if target is not None and holds_last:
            targets = _named_split("target", target, self.chunks)
            if holds_first and mbatch.batch_size(target) != mbatch.batch_size(x):
                raise ValueError(
                    f"x and target have different batch sizes: {mbatch.batch_size(x)} and "
                    f"{mbatch.batch_size(target)}"
                )
        return inputs, targets

    def _run(self, schedule: Schedule, inputs, targets, loss_fn, train: bool,
             refuse: BaseException | None = None) -> dict[int, Any]:
        if self.distributed:
            try:
                self._finish_loss_broadcast()
            except BaseException as exc:  # the last step's end failed: the group is out of step
                self._broken = exc
                raise
            transport = self._transport(self.rank, None)
            transport.all_actions = schedule.actions  # exact messages follow the senders' order
            average = self._grad_average if train else None
            executor = RankExecutor(self.rank, schedule, self._stages[self.rank], transport,
                                    self.checkpoint, fused_wgrad=self.fused_wgrad,
                                    autocast=autocast_state(),
                                    grads_done=average.stage_done if average is not None else None)
            if self._recording is not None:
                dist.barrier(group=self.group)  # every rank's clock starts together
                executor.records = self._recording
            # NCCL: the rank's work runs on its own compute stream; isend is
            # issued there after the data's kernels, and Work.wait() there
            # orders the consumer after the receive (see DistTransport).
            lanes = self._lanes_of(self.rank) if self._nccl else None
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
                self._broken = exc
                raise
            finally:
                if train:
                    self._memory[self.rank] = executor.peak_activation_bytes
                    self._input_grads = executor.input_grads
        return self._run_local(schedule, inputs, targets, loss_fn, train)

    def _run_local(self, schedule, inputs, targets, loss_fn, train) -> dict[int, Any]:
        ties = self._local_ties
        if ties is None:
            return self._run_ranks(schedule, inputs, targets, loss_fn, train)
        with ties.swapped():  # replicas of parameters tied across ranks, for this call
            results = self._run_ranks(schedule, inputs, targets, loss_fn, train)
            if train:
                ties.gather()
            return results

    def _run_ranks(self, schedule, inputs, targets, loss_fn, train) -> dict[int, Any]:
        """Local mode: one thread per rank on the native ring's lanes."""
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
            for stages in self._stages.values() for st in stages.values())
        rng_lock = threading.Lock() if self.checkpoint != "never" or shared else None
        rng_seed = int(torch.randint(0, 1 << 62, ()).item()) if shared else None
        last_rank = self._owner(schedule.stages - 1)
        origin = time.perf_counter()
        amp = autocast_state()  # thread-local: read here, applied on each rank's lane

        transports = [self._transport(rank, mailbox) for rank in range(schedule.ranks)]
        lanes = [self._lanes_of(rank) for rank in range(schedule.ranks)] if self._copies else []
        for rank_lanes in lanes:
            rank_lanes.enter_from_caller()

        def run_rank(rank: int):
            executor = RankExecutor(rank, schedule, self._stages[rank], transports[rank],
                                    self.checkpoint, rng_lock, keep_graphs=True,
                                    fused_wgrad=self.fused_wgrad, autocast=amp,
                                    python_chains=False, rng_seed=rng_seed)
            if self._recording is not None:
                executor.records, executor.origin = [], origin
            try:
                with lanes[rank].compute() if lanes else nullcontext():
                    return executor.run(inputs, targets, loss_fn, train)  # fails the mailbox on error
            finally:
                if train:
                    self._memory[rank] = executor.peak_activation_bytes
                    if 0 in self._stages[rank]:
                        self._input_grads = executor.input_grads
                if executor.records is not None:
                    self._recording.extend(executor.records)  # list.extend is atomic

        with switch_interval(self._switch_interval if schedule.ranks > 1 else None):
            events = [self._ring.submit(r, with_caller_threads(lambda r=r: run_rank(r)))
                      for r in range(schedule.ranks)]
            try:
                outcomes = [_outcome(ev) for ev in events]
            except KeyboardInterrupt as exc:
                mailbox.fail(-1, exc)  # unblock the workers, then let them finish
                for ev in events:
                    _outcome(ev)
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
        return outcomes[last_rank]

    def _mean_loss(self, results: dict[int, torch.Tensor]) -> torch.Tensor:
        if results:
            loss = torch.stack([results[mb] for mb in range(self.chunks)]).mean()
            if not self.distributed:
                return loss
            code = float(_LOSS_DTYPES.index(loss.dtype)) if loss.dtype in _LOSS_DTYPES else 0.0
            packed = torch.stack([loss.double().cpu(), torch.tensor(code, dtype=torch.float64)])
        else:
            packed = torch.zeros(2, dtype=torch.float64)
        # The loss's dtype is only known where it was computed: send it along.
        device = self.devices[self.rank]
        packed = packed.to(device)
        owner = self._owner(self.schedule.stages - 1)
        src = dist.get_global_rank(self.group, owner) if self.group is not None else owner
        if self.rank == owner:
            # The other ranks need the value; this one has it. Not waiting
            # here takes the broadcast off this rank's step: its peers reach
            # it only after their last backward (on the narrow benchmark
            # model ~1 ms of the last rank's ~16 ms step was this wait).
            self._finish_loss_broadcast()
            self._loss_broadcast = (dist.broadcast(packed, src=src, group=self.group,
                                                   async_op=True), packed)
            return packed[0].to(_LOSS_DTYPES[int(code)])  # what the others get (read only)
        dist.broadcast(packed, src=src, group=self.group)
        return packed[0].to(_LOSS_DTYPES[int(packed[1].item())])

    def _finish_loss_broadcast(self) -> None:
        """Waits for the last step's loss broadcast, if it is still in flight."""
        if self._loss_broadcast is not None:
            work, _ = self._loss_broadcast
            self._loss_broadcast = None
            work.wait()

    def close(self) -> None:
        """Stops the pipe's lanes of the native ring (also done at interpreter exit)
        and gives its CUDA streams back to the process's pool, which keeps them:
        torch may still refer to them (``runtime/streams.py``). A later step
        makes both afresh."""
        try:
            self._finish_loss_broadcast()
        finally:
            if self._ring is not None:
                self._ring.close()
                self._ring = None
            for lanes in self._device_lanes.values():
                lanes.close()
            self._device_lanes.clear()

    def extra_repr(self) -> str:
        return (f"schedule={self.schedule.name!r}, chunks={self.chunks}, balance={self.balance}, "
                f"checkpoint={self.checkpoint!r}")


def _named_split(name: str, batch: Any, chunks: int) -> list:
    """``mbatch.split``, its errors naming the argument."""
    try:
        return mbatch.split(batch, chunks)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


class _InferenceOnly(torch.autograd.Function):
    """Marks ``pipe(x)``'s output as one autograd cannot go back through:
    in grad mode it requires grad, as a module's output would, and a
    backward through it says what to call instead of torch's "does not
    require grad"."""

    @staticmethod
    def forward(ctx, x, parameter):  # the parameter makes autograd track the output
        return x.detach()  # not a view: in-place ops on the output stay allowed

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "the output of pipe(x) has no graph: Pipe.forward runs the microbatches without "
            "autograd; train with loss = pipe.step(x, target, loss_fn), which runs the "
            "backward of every microbatch")


def _no_backward(value: Any, parameter: torch.Tensor) -> Any:
    if isinstance(value, tuple):
        return tuple(_no_backward(v, parameter) for v in value)
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return _InferenceOnly.apply(value, parameter)
    return value


def _backward_into_inputs(x: Any, grads: dict[int, list[torch.Tensor]], chunks: int) -> None:
    """Carries the first stage's input gradients into the caller's tensors:
    one backward for the whole batch (into ``x.grad`` for a leaf, on
    through the graph that made ``x`` otherwise), as ``loss.backward()``
    on the unsplit model does."""
    wanting = [t for t in (x if isinstance(x, tuple) else (x,)) if t.requires_grad]
    whole = [torch.cat([grads[mb][i] for mb in range(chunks)]).to(t.device)
             for i, t in enumerate(wanting)]
    torch.autograd.backward(wanting, whole)


def _outcome(event) -> Any:
    """The rank's result, or the exception it ended with (reported once all stopped)."""
    try:
        return event.wait()
    except Exception as exc:  # noqa: BLE001
        return exc


# --- argument checks -------------------------------------------------------------


def _meta_problem(layers: list[nn.Module], indices: Sequence[int]) -> str | None:
    """What is wrong when one of ``layers[indices]`` holds meta tensors (no
    data to compute with), or None."""
    for i in indices:
        if any(t.is_meta for t in itertools.chain(layers[i].parameters(), layers[i].buffers())):
            return (f"layer {i} ({type(layers[i]).__name__}) has tensors on the meta device (no "
                    "data), e.g. released by an earlier Pipe with free_remote=True; build the "
                    "model again (or materialize it) before this Pipe")
    return None


def _to_meta(module: nn.Module, keep: set[int] = frozenset()) -> None:
    """Swaps every parameter and buffer of ``module`` for a meta tensor of
    the same shape, dtype and ``requires_grad`` (a tensor's ``.data`` cannot
    change to the meta device, so the module's entries are replaced; a
    parameter used twice inside ``module`` stays one parameter), except
    those whose ``id`` is in ``keep``."""
    swapped: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table, make in ((sub._parameters, _meta_parameter), (sub._buffers, _meta_tensor)):
            for name, t in table.items():
                if t is not None and not t.is_meta and id(t) not in keep:
                    if id(t) not in swapped:
                        swapped[id(t)] = make(t)
                    table[name] = swapped[id(t)]


def _meta_tensor(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _meta_parameter(p: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(_meta_tensor(p), requires_grad=p.requires_grad)


def _raise_first(problems: list[str | None]) -> None:
    """ValueError naming the first rank that found a set-up problem (the
    same on every rank: ``problems`` was gathered from all of them)."""
    for rank, problem in enumerate(problems):
        if problem is not None:
            raise ValueError(f"pipeline rank {rank}: {problem}")


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"Pipe needs an nn.Sequential, got {type(model).__name__}")
    if len(model) == 0:
        raise ValueError("Pipe needs an nn.Sequential with at least one layer, got an empty one")


def _from_plan(plan, chunks, schedule, balance, stages_per_rank, checkpoint):
    """The plan's arguments; explicit non-default ones must agree with it."""
    from fastpipe._plan import Plan

    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a fastpipe.Plan (from fastpipe.plan(...)), got {type(plan).__name__}")
    chosen = plan.pipe_kwargs()
    given = {"chunks": (chunks, 8), "schedule": (schedule, "1f1b"), "balance": (balance, None),
             "stages_per_rank": (stages_per_rank, None), "checkpoint": (checkpoint, "never")}
    for name, (value, default) in given.items():
        if value != default and value != chosen[name]:
            raise ValueError(f"{name}={value!r} disagrees with the plan's {name}={chosen[name]!r}")
    return (chosen["chunks"], chosen["schedule"], chosen["balance"], chosen["stages_per_rank"],
            chosen["checkpoint"])


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def _check_chunks(chunks: Any) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"chunks must be an int, got {type(chunks).__name__} ({chunks!r})")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")


def _resolve_devices(devices, ranks, distributed, group) -> list[torch.device]:
    if devices is None:
        if distributed:
            backend = dist.get_backend(group)
            if backend == "nccl":
                return [torch.device("cuda", torch.cuda.current_device())] * ranks
            return [torch.device("cpu")] * ranks
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(
                "local mode needs devices, one per pipeline rank, e.g. devices=['cpu', 'cpu']"
            )
        return [torch.device("cuda", i) for i in range(count)]
    if isinstance(devices, (str, torch.device, int)) or len(devices) == 0:
        raise ValueError(f"devices must be a non-empty list, one per pipeline rank, got {devices!r}")
    out = []
    for d in devices:
        try:
            out.append(torch.device(d))
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"unknown device {d!r} in devices={list(devices)!r}") from err
    if ranks is not None and len(out) != ranks:
        raise ValueError(f"devices has {len(out)} entries but the process group has {ranks} ranks")
    cuda = [d for d in out if d.type == "cuda"]
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"devices={[str(d) for d in out]!r} names CUDA devices, but torch has no "
                           "usable CUDA here (a CPU build of torch, or no GPU/driver)")
    count = torch.cuda.device_count() if cuda else 0
    for d in cuda:
        if d.index is not None and d.index >= count:
            raise ValueError(f"device {d} in devices={[str(x) for x in out]!r} does not exist: "
                             f"{count} CUDA devices")
    # "cuda" means the current device, as in torch; fixed here so that device
    # comparisons and streams later on see one index.
    return [torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None
            else d for d in out]


def _mesh_groups(mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(pipeline group, data-parallel group or None) of a ("dp", "pp") or ("pp",) DeviceMesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                        f"{type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (("dp", "pp"), ("pp",)):
        raise ValueError(f"mesh must have dimensions ('dp', 'pp') or ('pp',), got {names!r} "
                         "(init_device_mesh(..., mesh_dim_names=('dp', 'pp')))")
    dp = mesh.get_group("dp") if "dp" in names and mesh.size(0) > 1 else None
    return mesh.get_group("pp"), dp


def _resolve_schedule(schedule, ranks: int, chunks: int, stages_per_rank) -> Schedule:
    if isinstance(schedule, Schedule):
        if schedule.ranks != ranks or schedule.microbatches != chunks:
            raise ValueError(
                f"schedule {schedule.name!r} is for {schedule.ranks} ranks and "
                f"{schedule.microbatches} microbatches, but the pipe has {ranks} ranks and "
                f"chunks={chunks}"
            )
        schedule.validate()
        return schedule
    if not isinstance(schedule, str):
        raise TypeError(f"schedule must be a name or a Schedule, got {type(schedule).__name__}")
    return build(schedule, ranks, chunks, stages_per_rank)


def _resolve_balance(balance, model: nn.Sequential, stages: int) -> list[int]:
    if len(model) < stages:
        raise ValueError(
            f"the model has {len(model)} layers but the schedule has {stages} stages "
            "(each stage needs at least one layer)"
        )
    if balance is None:
        return balance_by_params(stages, model)
    balance = list(balance)
    if len(balance) != stages:
        raise ValueError(
            f"balance has {len(balance)} entries but the schedule has {stages} stages: {balance}"
        )
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"every balance entry must be a positive int, got {balance}")
    if sum(balance) != len(model):
        raise ValueError(
            f"module and sum of balance have different length (module: {len(model)}, "
            f"sum of balance: {sum(balance)})"
        )
    return balance


def _ranges(balance: Sequence[int]) -> list[range]:
    """The layer indices of each stage under ``balance``."""
    bounds = list(itertools.accumulate(balance, initial=0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _forward_schedule(schedule: Schedule) -> Schedule:
    """Forward-only actions with the same placement: per rank, stage by stage."""
    actions = []
    for rank in range(schedule.ranks):
        held = [s for s in range(schedule.stages) if schedule.stage_to_rank[s] == rank]
        actions.append(
            [Action(s, Kind.F, mb) for s in held for mb in range(schedule.microbatches)]
        )
    return Schedule(
        name=f"{schedule.name}-forward",
        ranks=schedule.ranks,
        stages=schedule.stages,
        microbatches=schedule.microbatches,
        stage_to_rank=tuple(schedule.stage_to_rank),
        actions=actions,
    )
