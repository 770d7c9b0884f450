"""What ``Pipe``'s arguments mean: each checked, with a built-in exception
naming the bad value, and resolved (devices, schedule, balance, the mesh's
groups, the ``FASTPIPE_*`` switches) into one frozen ``Settings`` before
anything is built."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpipe import _microbatch as mbatch
from fastpipe.balance import balance_by_params
from fastpipe.schedules import Action, Kind, Schedule, build

__all__ = [
    "Settings", "Switches", "check_chunks", "check_model", "check_timeout", "forward_schedule", "from_plan", "loss_scale", "mesh_groups",
    "named_split", "raise_first", "ranges", "resolve_balance", "resolve_devices", "resolve_schedule", "scaled_loss", "settings",
    "switches",
]


@dataclass(frozen=True)
class Settings:
    """A Pipe's arguments, checked and resolved, and the ``FASTPIPE_*``
    switches read when it is built (nothing reads them later)."""

    chunks: int
    schedule: Schedule
    balance: list[int] | None  # None: "auto", split at the first step by measured time
    devices: list[torch.device]
    group: dist.ProcessGroup | None  # the pipeline's group (distributed mode)
    dp_group: dist.ProcessGroup | None  # the data-parallel group of a ("dp", "pp") mesh
    distributed: bool
    rank: int | None  # this process's pipeline rank (distributed mode)
    nccl: bool
    exact: bool  # NCCL's message rules (FASTPIPE_EXACT_MESSAGES=1 applies them on gloo)
    overlap: bool
    timeout: float
    checkpoint: str
    recompute: str
    wire: dict  # {"F": activations' wire dtype or None, "B": gradients'}
    fused_wgrad: bool
    shm: bool | None  # FASTPIPE_SHM=0 is shm=False
    free_remote: bool
    switches: Switches
    by_name: bool = False  # the schedule was given by name (its order is fastpipe's to choose)


@dataclass(frozen=True)
class Switches:
    """The ``FASTPIPE_*`` environment switches that choose an internal path
    (each one's default is the fast path; the others exist to compare with
    it, or to run a GPU's path on CPUs). ``docs/design/pipe.md`` lists them."""

    chains: str = "on"  # FASTPIPE_CHAIN: "on", "off" (autograd), "python" (ops issued from Python, local mode too)
    gather_w: bool = True  # FASTPIPE_CHAIN_GATHER=0: each W at once, autograd's rounding
    known_losses: bool = True  # FASTPIPE_KNOWN_LOSS=0: a loss after a chain stage through autograd
    shm_bytes: str = ""  # FASTPIPE_SHM_BYTES, as given: parsed by the collective set-up, which refuses it on every rank
    copies: bool | None = None  # FASTPIPE_COPY_LANES=1: local transfers as copies on lanes on CPUs too (None: on GPUs)
    switch_interval: float | None = None  # FASTPIPE_SWITCH_INTERVAL: the GIL's, in seconds, while local ranks run
    exact_messages: bool = False  # FASTPIPE_EXACT_MESSAGES=1: NCCL's message rules on gloo too
    shm_off: bool = False  # FASTPIPE_SHM=0: shm=None means False
    problem: str | None = None  # the switches that could not be read, raised on every rank


def switches(environ=os.environ) -> Switches:
    """The switches as ``environ`` sets them. A value it cannot read leaves
    that switch at its default and is named in ``problem``, which the Pipe
    raises as a ValueError on every rank (a rank raising alone would leave
    the others waiting in the set-up's collectives)."""
    problems = []
    chain = environ.get("FASTPIPE_CHAIN", "") or "1"
    modes = {"1": "on", "on": "on", "true": "on", "0": "off", "off": "off", "false": "off",
             "python": "python"}
    if chain.lower() not in modes:
        problems.append(f"FASTPIPE_CHAIN must be 1, 0 or python, got {chain!r}")
    interval = environ.get("FASTPIPE_SWITCH_INTERVAL") or None
    try:
        seconds = None if interval is None else float(interval)
    except ValueError:
        seconds = -1.0
    if seconds is not None and not seconds > 0:
        problems.append(f"FASTPIPE_SWITCH_INTERVAL must be a number of seconds > 0, got {interval!r}")
        seconds = None
    return Switches(chains=modes.get(chain.lower(), "on"),
                    gather_w=environ.get("FASTPIPE_CHAIN_GATHER", "1") != "0",
                    known_losses=environ.get("FASTPIPE_KNOWN_LOSS", "1") != "0",
                    shm_bytes=environ.get("FASTPIPE_SHM_BYTES", ""),
                    copies=True if environ.get("FASTPIPE_COPY_LANES") == "1" else None,
                    switch_interval=seconds,
                    exact_messages=environ.get("FASTPIPE_EXACT_MESSAGES") == "1",
                    shm_off=environ.get("FASTPIPE_SHM", "1") == "0",
                    problem="; ".join(problems) or None)


def settings(model: Any, chunks, schedule, balance, devices, stages_per_rank, group, mesh, timeout,
             overlap, checkpoint, recompute, wire_dtype, grad_wire_dtype, plan, fused_wgrad, shm,
             free_remote) -> Settings:
    """``Pipe``'s arguments (see its docstring), checked and resolved.

    Raises:
        TypeError / ValueError: naming the first argument that is wrong and its value.
    """
    check_model(model)
    env = switches()
    _check_flags(shm=(shm, True), fused_wgrad=(fused_wgrad, False), free_remote=(free_remote, False),
                 overlap=(overlap, True))
    if plan is not None:
        chunks, schedule, balance, stages_per_rank, checkpoint = from_plan(
            plan, chunks, schedule, balance, stages_per_rank, checkpoint)
    check_chunks(chunks)
    by_name = isinstance(schedule, str)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be 'none' or 'selective', got {recompute!r}")
    from fastpipe.runtime.checkpoint import check_mode
    from fastpipe.runtime.packing import check_wire

    check_mode(checkpoint)
    check_wire(wire_dtype)
    check_wire(grad_wire_dtype)
    dp_group = None
    if mesh is not None:
        if group is not None:
            raise ValueError("pass group= or mesh=, not both: the mesh's 'pp' dimension is the group")
        group, dp_group = mesh_groups(mesh)
    distributed = group is not None or (dist.is_available() and dist.is_initialized())
    if env.problem is not None and not distributed:  # distributed: Placement raises it on every rank
        raise ValueError(env.problem)
    ranks = dist.get_world_size(group) if distributed else None
    devices = resolve_devices(devices, ranks, distributed, group)
    ranks = len(devices) if ranks is None else ranks
    nccl = distributed and dist.get_backend(group) == "nccl"
    exact = distributed and (nccl or env.exact_messages)
    if exact and overlap:
        raise ValueError("overlap=True is not supported on NCCL: its P2P already runs on NCCL's own "
                         "streams, and fastpipe issues it from the rank's compute stream (leave "
                         "overlap=None)")
    resolved = resolve_schedule(schedule, ranks, chunks, stages_per_rank)
    if isinstance(balance, str) and balance != "auto":
        raise ValueError(f"balance must be a list of ints, None or 'auto', got {balance!r}")
    if shm is None and env.shm_off:
        shm = False
    if shm and not distributed:
        raise ValueError("shm=True applies to distributed mode (ranks in separate processes); "
                         "local-mode ranks share one process and hand tensors over directly")
    if free_remote and not distributed:
        raise ValueError("free_remote=True applies to distributed mode: in local mode every "
                         "stage runs in this process, so no layer is held elsewhere")
    return Settings(
        chunks=chunks, schedule=resolved, devices=devices, group=group, dp_group=dp_group,
        balance=None if balance == "auto" else resolve_balance(balance, model, resolved.stages),
        distributed=distributed, rank=dist.get_rank(group) if distributed else None, nccl=nccl,
        exact=exact, timeout=check_timeout(timeout),
        overlap=overlap if overlap is not None else not exact and any(d.type != "cpu" for d in devices),
        checkpoint=checkpoint, recompute=recompute, wire={"F": wire_dtype, "B": grad_wire_dtype},
        fused_wgrad=fused_wgrad, shm=shm, free_remote=free_remote, switches=env, by_name=by_name)


def loss_scale(scaler, group: dist.ProcessGroup | None, distributed: bool,
               device: torch.device) -> torch.Tensor | None:
    """The factor ``step(scaler=)`` scales losses by now, a 0-dim tensor on
    ``device`` (read without a host sync), or None (no scaler, or a
    disabled one).

    In distributed mode each rank's scaler sees only its own stages'
    gradients, so ranks must agree on a step with an inf: the scaler must be
    a ``ShardedGradScaler``, which combines found-inf over its process group,
    and that group must hold every rank of the pipeline (``group``).

    Raises:
        TypeError: not a ``torch.amp.GradScaler``; distributed mode and not a
            ``ShardedGradScaler``.
        ValueError: the ShardedGradScaler's group leaves out pipeline ranks.
    """
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if not scaler.is_enabled():  # GradScaler(enabled=False): nothing to scale, any kind will do
        return None
    if distributed:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if not isinstance(scaler, ShardedGradScaler):
            raise TypeError(
                f"in distributed mode scaler must be a torch.distributed.fsdp.sharded_grad_scaler."
                f"ShardedGradScaler, got {type(scaler).__name__}: each rank holds only its stages' "
                "gradients, and a ShardedGradScaler combines found-inf over its process group so "
                "every rank skips the same steps")
        mine, theirs = (set(dist.get_process_group_ranks(g or dist.group.WORLD))
                        for g in (group, scaler.process_group))
        if not mine <= theirs:
            raise ValueError(f"the ShardedGradScaler's process group (ranks {sorted(theirs)}) must "
                             f"hold every pipeline rank (global ranks {sorted(mine)})")
    return scaler.scale(torch.ones((), dtype=torch.float32, device=device))


def scaled_loss(loss_fn, factor: torch.Tensor):
    """``loss_fn`` times ``factor``, as ``scaler.scale(loss)`` (no host sync).
    A known loss wrapped so is not known any more: after a chain stage it
    goes through autograd (``runtime/losses.py``)."""

    def scaled(out, target):
        loss = loss_fn(out, target)
        return loss * factor.to(loss.device) if isinstance(loss, torch.Tensor) else loss

    return scaled


def _check_flags(**flags: tuple[Any, bool]) -> None:
    """Each ``name=(value, None allowed)`` is a bool (or None where allowed)."""
    for name, (value, optional) in flags.items():
        if not (isinstance(value, bool) or optional and value is None):
            allowed = "a bool or None" if optional else "a bool"
            raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} ({value!r})")


def named_split(name: str, batch: Any, chunks: int) -> list:
    """``mbatch.split``, its errors naming the argument."""
    try:
        return mbatch.split(batch, chunks)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def raise_first(problems: list[str | None]) -> None:
    """ValueError naming the first rank that found a set-up problem (the
    same on every rank: ``problems`` was gathered from all of them)."""
    for rank, problem in enumerate(problems):
        if problem is not None:
            raise ValueError(f"pipeline rank {rank}: {problem}")


def check_model(model: Any) -> None:
    if type(model).__name__ == "OptimizedModule":  # torch.compile(model)
        raise TypeError("Pipe needs an nn.Sequential, got torch.compile's OptimizedModule: a "
                        "compiled model is one graph that cannot be split into stages; compile the "
                        "layers (or blocks) instead, e.g. model[i] = torch.compile(model[i]), and "
                        "pass the nn.Sequential")
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"Pipe needs an nn.Sequential, got {type(model).__name__}")
    if len(model) == 0:
        raise ValueError("Pipe needs an nn.Sequential with at least one layer, got an empty one")


def from_plan(plan, chunks, schedule, balance, stages_per_rank, checkpoint):
    """The plan's arguments; explicit non-default ones must agree with it."""
    from fastpipe._plan import Plan

    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a fastpipe.Plan (from fastpipe.plan(...)), got {type(plan).__name__}")
    chosen = plan.pipe_kwargs()
    named = {**chosen, "schedule": plan.schedule}  # the name, also where the plan ordered it by cost
    given = {"chunks": (chunks, 8), "schedule": (schedule, "1f1b"), "balance": (balance, None),
             "stages_per_rank": (stages_per_rank, None), "checkpoint": (checkpoint, "never")}
    for name, (value, default) in given.items():
        if value != default and value != named[name]:
            raise ValueError(f"{name}={value!r} disagrees with the plan's {name}={named[name]!r}")
    return (chosen["chunks"], chosen["schedule"], chosen["balance"], chosen["stages_per_rank"],
            chosen["checkpoint"])


def check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def check_chunks(chunks: Any) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"chunks must be an int, got {type(chunks).__name__} ({chunks!r})")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")


def resolve_devices(devices, ranks, distributed, group) -> list[torch.device]:
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


def mesh_groups(mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
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


def resolve_schedule(schedule, ranks: int, chunks: int, stages_per_rank) -> Schedule:
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


def resolve_balance(balance, model: nn.Sequential, stages: int) -> list[int]:
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


def ranges(balance: Sequence[int]) -> list[range]:
    """The layer indices of each stage under ``balance``."""
    bounds = list(itertools.accumulate(balance, initial=0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def forward_schedule(schedule: Schedule) -> Schedule:
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
