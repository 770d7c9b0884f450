"""Where a Pipe's layers run: the balance, this process's stages, the
parameters several stages share, and the set-up collectives that make every
rank agree on them before a step."""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpipe import _args
from fastpipe._args import Settings
from fastpipe._dist_run import ranks_agree
from fastpipe._stages import Fresh, build_stages, free_remote, meta_problem, unwritten, written
from fastpipe._ties import LocalTies, TiedGrads, check_local, find_ties
from fastpipe.runtime.executor import Stage, last_backward

__all__ = ["Placement"]

log = logging.getLogger(__name__)


class Placement:
    """The stages of ``model`` this process runs, under ``cfg``.

    Made with the Pipe; with ``balance="auto"`` the stages wait for
    :meth:`split_by_time` at the first step (``stages`` is None until then).
    In distributed mode a problem with one rank's stages (``problem``) is
    raised on every rank, by :meth:`check_ranks_agree` or ``split_by_time``.

    Attributes:
        balance: layers per stage (None until the split by time).
        stages: ``{rank: {stage: Stage}}`` for this process's ranks.
        ties: parameters used by layers of several stages (``fastpipe._ties``).
        tied: distributed mode: TiedGrads of the ties that span ranks, or None.
        local_ties: local mode: LocalTies of the ties that span ranks, or None.
        layers: the model's layers when the stages were built.
    """

    def __init__(self, model: nn.Sequential, cfg: Settings) -> None:
        self.model, self.cfg = model, cfg
        self.ties: list = []
        self.tied: TiedGrads | None = None
        self.local_ties: LocalTies | None = None
        self.layers: tuple[nn.Module, ...] = ()
        # Tensors made from a model built on meta, until the first step
        # finds them all written (check_weights).
        self.fresh: list[Fresh] = []
        if cfg.balance is not None:
            self._find_ties(cfg.balance)
        if cfg.recompute == "selective":  # changes the user's model in place: after every check
            from fastpipe.kernels import selective_recompute

            selective_recompute(model)
        self.balance = cfg.balance
        self.order = None  # balance="auto": a zero-bubble order for the measured costs
        self.problem: str | None = None
        self.stages = None if cfg.balance is None else self._build()

    def ranks(self) -> list[int]:
        """The pipeline ranks this process runs."""
        cfg = self.cfg
        return [cfg.rank] if cfg.distributed else list(range(cfg.schedule.ranks))

    def ranges(self) -> list[range]:
        """The model's layer indices of each stage."""
        return _args.ranges(self.balance)

    def held_layers(self) -> list[int]:
        """The model's layer indices this process runs (every layer in local mode)."""
        if not self.cfg.distributed:
            return list(range(len(self.model)))
        if self.stages is None:
            raise RuntimeError("with balance='auto' the split is made at the first step: "
                               "call step (or forward) before state_dict or load_state_dict")
        ranges = self.ranges()
        return [i for s in sorted(self.stages[self.cfg.rank]) for i in ranges[s]]

    def held(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The entries of ``named`` that this process's stages hold (all of
        them in local mode, or before the split by time)."""
        if not self.cfg.distributed or self.stages is None:
            yield from named
            return
        held = {id(t) for st in self.stages[self.cfg.rank].values()
                for t in itertools.chain(st.module.parameters(), st.module.buffers())}
        yield from ((name, t) for name, t in named if id(t) in held)

    def held_parameters(self) -> list[nn.Parameter]:
        """This process's parameters, each once (stages may share one)."""
        if not self.cfg.distributed:
            return list(self.model.parameters())
        return list({id(p): p for st in self.stages.get(self.cfg.rank, {}).values()
                     for p in st.module.parameters()}.values())

    def split_by_time(self, x: Any, loss_fn=None, target: Any = None) -> None:
        """balance="auto": the first stage's rank profiles every layer on the
        first microbatch of ``x``; every rank (and replica) takes its split,
        then builds its stages. Every rank raises, or none. A built-in
        zero-bubble schedule also gets the order for the profiled stage costs
        where that simulates faster (``fastpipe._plan.order_for``):
        ``order``, which the Pipe then runs; None keeps the schedule.
        A training step's ``loss_fn`` and ``target`` are profiled with the
        last layer (its time and the bytes the loss saves) where the
        profiling rank has the target (ranks without the last stage may
        pass None), and left out where the loss fails on it (a placeholder
        target). Should profiling fail there, every rank raises: the
        profiling rank its own error, the others a RuntimeError naming it."""
        from fastpipe._plan import order_for
        from fastpipe.balance import balance_from_profile

        cfg, chosen = self.cfg, (None, None)
        holder = cfg.schedule.stage_to_rank[0]
        profiles = not cfg.distributed or cfg.rank == holder  # it must hold every layer
        mine = meta_problem(list(self.model), range(len(self.model))) if profiles else None
        self._raise_on_all(mine)
        failed: Exception | None = None
        if profiles:
            try:
                prof = self._profile(x, cfg.devices[holder], loss_fn, target)
                balance = balance_from_profile(prof, cfg.schedule.stages, schedule=cfg.schedule)
                chosen = balance, order_for(prof, balance, cfg.schedule, cfg.checkpoint)
            except Exception as exc:
                if not cfg.distributed:
                    raise
                # The others wait in the broadcast below: they get the reason instead.
                failed, chosen = exc, f"{type(exc).__name__}: {exc}"
        if cfg.distributed:
            box = [chosen]
            src = dist.get_global_rank(cfg.group, holder) if cfg.group is not None else holder
            dist.broadcast_object_list(box, src=src, group=cfg.group)
            if cfg.dp_group is not None:  # every replica takes the first one's split
                dist.broadcast_object_list(box, src=dist.get_global_rank(cfg.dp_group, 0),
                                           group=cfg.dp_group)
            chosen = box[0]
            if isinstance(chosen, str):
                if failed is not None:
                    raise failed
                raise RuntimeError(f'balance="auto": profiling the layers on pipeline rank {holder} '
                                   f"failed: {chosen}")
        balance, self.order = chosen
        self.balance = _args.resolve_balance(balance, self.model, cfg.schedule.stages)
        self._find_ties(self.balance)
        self.stages = self._build()
        self._raise_on_all(self.problem)
        if cfg.free_remote:
            self.free_remote()
        log.info("pipe: balance by time %s", self.balance)

    def _profile(self, x: Any, device, loss_fn, target):
        """``split_by_time``'s profile: with the step's loss where it runs on
        this rank's target, else the layers alone (a target given for form's
        sake: the last stage's rank computes the loss)."""
        from fastpipe.balance import profile

        if loss_fn is not None and target is not None:
            try:
                return profile(self.model, x, device, self.cfg.chunks, loss_fn=loss_fn, target=target)
            except Exception as exc:
                log.info("pipe: balance='auto' profiles the layers without the loss (%s: %s)",
                         type(exc).__name__, exc)
        return profile(self.model, x, device, self.cfg.chunks)

    def check_ranks_agree(self) -> None:
        """One small collective: every rank must have built the same pipeline.

        Raises (on every rank):
            ValueError: this or another rank's ``problem``, or the first
                setting that differs with each rank's value.
        """
        cfg = self.cfg
        mine = {
            "layers": len(self.model), "chunks": cfg.chunks, "schedule": cfg.schedule.name,
            # Two orders of one schedule (each rank's own plan, say) would wait on each other.
            "schedule's action order (digest)": _digest(cfg.schedule.actions),
            "stages": cfg.schedule.stages, "placement": tuple(cfg.schedule.stage_to_rank),
            "balance": "auto" if self.balance is None else tuple(self.balance),
            "checkpoint": cfg.checkpoint, "recompute": cfg.recompute,
            "wire_dtype": str(cfg.wire["F"]), "grad_wire_dtype": str(cfg.wire["B"]),
            "exact messages": cfg.exact,  # tags or order: both ends must agree
            "shm": cfg.shm,  # the rings are set up collectively: every rank must take part
            # Summed after every step by all ranks together (fastpipe._ties).
            "tied parameters": tuple((t.name, t.stages) for t in self.ties),
        }
        groups = [(cfg.group, "pipeline ranks")]
        if cfg.dp_group is not None:
            groups.append((cfg.dp_group, "data-parallel replicas"))
        ranks_agree(mine, self.problem or cfg.switches.problem, groups)

    def check_weights(self) -> None:
        """Before the first step: every tensor made from a model built on
        meta has been written, and copies of one tensor on several ranks (a
        parameter tied across ranks; a rank's stages across data-parallel
        replicas) hold the same values. Collective over the pipeline group
        and the dp group in distributed mode; every rank raises, or none.

        Raises:
            ValueError: naming the tensor (and the ranks), and how to fix it.
        """
        from fastpipe._data_parallel import check_weights
        from fastpipe._state import held_state_dict

        cfg = self.cfg
        problem = self._unwritten_problem()
        if not cfg.distributed:
            if problem is not None:
                raise ValueError(problem)
        else:
            tied = self.tied.ties if self.tied is not None else []
            held = held_state_dict(self.model, self.held_layers(), keep_vars=True) \
                if cfg.dp_group is not None else {}
            check_weights(tied, cfg.rank, held, cfg.group, cfg.dp_group, cfg.devices[cfg.rank],
                          problem)
        written(self.fresh)
        self.fresh = []

    def check_written(self) -> None:
        """``check_weights``' first half alone, for a forward: every tensor
        made from a model built on meta has been written. Collective over
        the pipeline group only in distributed mode (inference talks to no
        other replica); every pipeline rank raises, or none.

        Raises:
            ValueError: naming the tensor, and how to fix it.
        """
        problem = self._unwritten_problem()
        if self.cfg.distributed:
            self._raise_on_all(problem)
        elif problem is not None:
            raise ValueError(problem)
        written(self.fresh)
        self.fresh = []

    def _unwritten_problem(self) -> str | None:
        names = unwritten(self.fresh)
        if not names:
            return None
        where = f"pipeline rank {self.cfg.rank}: " if self.cfg.distributed else ""
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        return (f"{where}{names[0]}{more} came from the meta device and nothing has written "
                "them (they hold the NaN, or for integers the empty memory, they were made "
                "with): load the values (pipe.load_state_dict, or "
                "torch.distributed.checkpoint.load into pipe.state_dict()) or initialize them "
                "(nn.init, reset_parameters() under torch.no_grad()) before the first step")

    def grad_average(self, lowered):
        """The data-parallel averaging of this rank's gradients over
        ``cfg.dp_group``, each stage's bucket started in the order of its
        last backward in ``lowered``."""
        from fastpipe._data_parallel import GradAverage

        rank = self.cfg.rank
        stages = {i: list(st.module.parameters()) for i, st in self.stages[rank].items()}
        done = last_backward(lowered.actions[rank])
        late = {id(t.param) for t in self.tied.ties} if self.tied is not None else set()
        return GradAverage(stages, sorted(stages, key=done.__getitem__), late, self.cfg.dp_group,
                           self.cfg.devices[rank])

    def free_remote(self) -> None:
        """The layers of other ranks' stages keep only meta tensors (``Pipe(free_remote=True)``)."""
        mine = [s for s, owner in enumerate(self.cfg.schedule.stage_to_rank) if owner == self.cfg.rank]
        free_remote(list(self.model), self.ranges(), mine)

    def _raise_on_all(self, problem: str | None) -> None:
        if self.cfg.distributed:
            everyone: list = [None] * self.cfg.schedule.ranks
            dist.all_gather_object(everyone, problem, group=self.cfg.group)
            _args.raise_first(everyone)
        elif problem is not None:
            raise ValueError(problem)

    def _find_ties(self, balance: list[int]) -> None:
        """In local mode checked here (one module run by two ranks is
        refused) and given replicas with the stages; in distributed mode
        summed across ranks after each step."""
        cfg, ranges = self.cfg, _args.ranges(balance)
        self.ties = find_ties(self.model, ranges, cfg.schedule.stage_to_rank)
        if not cfg.distributed:
            check_local(self.ties, self.model, ranges, cfg.schedule.stage_to_rank)
            return
        across = [t for t in self.ties if len(t.ranks) > 1]
        tied = TiedGrads(across, cfg.rank, cfg.devices[cfg.rank], cfg.group)
        self.tied = tied if tied else None

    def _build(self) -> dict[int, dict[int, Stage]]:
        cfg = self.cfg
        stages, self.problem, self.fresh = build_stages(
            list(self.model), self.ranges(), cfg.schedule.stage_to_rank, self.ranks(), cfg.devices,
            cfg.switches.chains)
        self.layers = tuple(self.model)  # what the stages hold (see Pipe._split_inputs)
        across = [t for t in self.ties if len(t.ranks) > 1]
        if not cfg.distributed and across and self.problem is None:
            self.local_ties = LocalTies(across, stages, cfg.devices)
        return stages


def _digest(actions) -> str:
    """A short digest of every rank's action list, the same in every process
    (``hash`` of a string is not)."""
    return hashlib.sha256(repr(actions).encode()).hexdigest()[:12]
