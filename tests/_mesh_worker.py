"""Body of the spawned gloo ranks of test_mesh: data × pipeline parallelism
on a ("dp", "pp") DeviceMesh, and checkpoints written and read with
torch.distributed.checkpoint (one file per rank)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from tests.support import rank_results

SPR = {"zbv": 2, "interleaved-1f1b": 2}
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def run(rank: int, world: int, init: str, cases: list[dict], out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "pp"))
    with rank_results(out_path) as results:
        for case in cases:
            kind = case["kind"]
            results.append(globals()["_" + kind](case, mesh))


def _pipe(case: dict, model: nn.Sequential, mesh=None):
    from fastpipe import Pipe

    return Pipe(model, chunks=case["chunks"], schedule=case["schedule"], mesh=mesh,
                balance=case.get("balance"), stages_per_rank=SPR.get(case["schedule"]), timeout=60,
                shm=case.get("shm", False), fused_wgrad=case.get("fused", True))


def _shard(batch, mesh):
    """This replica's rows of a global batch."""
    dp = mesh.get_local_rank("dp")
    return tuple(torch.tensor_split(t, mesh.size(0))[dp] for t in batch)


def _loss_fn(case):
    from tests import models

    return models.lm_loss if case.get("lm") else nn.functional.mse_loss


def _grads(case: dict, mesh) -> dict:
    """Steps of one Pipe per replica; each rank's gradients and losses."""
    from tests import models

    model = getattr(models, case["model"])()
    pipe = _pipe(case, model, mesh)
    losses, seen = [], []  # forced_order: what the reorder after the second step was given
    restore = _force_order(seen) if case.get("forced_order") else (lambda: None)
    try:
        for batch in case["batches"]:
            losses.append(pipe.step(*_shard(batch, mesh), _loss_fn(case)))
    finally:
        restore()
    norm = pipe.clip_grad_norm_(case["clip"]) if case.get("clip") else None
    held = pipe.state_dict(keep_vars=True)
    grads = {n: t.grad for n, t in held.items() if isinstance(t, nn.Parameter) and t.grad is not None}
    return {"losses": losses, "grads": grads, "norm": norm, "measured": seen,
            "order": pipe.schedule.actions}


def _force_order(seen: list):
    from tests._dist_worker import _force_order as force

    return force(seen)


def _refused(case: dict, mesh) -> dict:
    """One replica builds its model from another seed: the first step refuses on every rank."""
    from tests import models

    seed = mesh.get_local_rank("dp") if case.get("apart") == "dp" else 0
    model = getattr(models, case["model"])(seed=seed)
    if case.get("apart") == "tie" and dist.get_rank() != 0:  # copies of a tied weight differ
        with torch.no_grad():
            model[0].weight.add_(1)
    pipe = _pipe(case, model, mesh if case.get("apart") == "dp" else None)
    try:
        pipe.step(*_shard(case["batches"][0], mesh), _loss_fn(case))
    except ValueError as exc:
        message = str(exc)
    else:
        message = None
    if case.get("apart") == "dp":  # a load before the first step puts them in step
        source = getattr(models, case["model"])(seed=0)
        pipe.load_state_dict(source.state_dict())
        pipe.step(*_shard(case["batches"][0], mesh), _loss_fn(case))
    return {"refused": message}


def _fails(case: dict, mesh) -> dict:
    """Replica 1's loss raises mid-step: every rank raises, none waits for
    the others; the next step refuses on every rank."""
    from tests import models
    from tests.support import FailsOnce

    pipe = _pipe(case, getattr(models, case["model"])(), mesh)
    loss_fn = _loss_fn(case)
    if mesh.get_local_rank("dp") == 1:
        loss_fn = FailsOnce(loss_fn, at=2)
    out = {}
    for when in ("step", "next step"):
        try:
            pipe.step(*_shard(case["batches"][0], mesh), loss_fn)
        except Exception as exc:
            out[when] = (type(exc).__name__, str(exc))
    return out


def _train(case: dict, mesh, model, pipe, steps, batches, opt) -> list[float]:
    losses = []
    for step in steps:
        opt.zero_grad()
        batch = batches[step]
        losses.append(pipe.step(*(_shard(batch, mesh) if pipe.dp_group is not None else batch),
                                _loss_fn(case)).item())
        opt.step()
    return losses


def _resume(case: dict, mesh) -> dict:
    """Trains on the mesh, saves model and optimizer with DCP, goes on
    training; then a model built from another seed, in a pipeline of
    another schedule and width over the whole world, loads the checkpoint
    and trains the same steps: both curves are returned."""
    from tests import models

    batches, saved_at, ckpt = case["batches"], case["saved_at"], case["path"]
    model = getattr(models, case["model"])()
    pipe = _pipe(case, model, mesh)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    before = _train(case, mesh, model, pipe, range(saved_at), batches, opt)
    model_sd, optim_sd = get_state_dict(pipe, opt, options=FLAT)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    mine = {n: t.clone() for n, t in pipe.state_dict().items()}
    after = _train(case, mesh, model, pipe, range(saved_at, len(batches)), batches, opt)
    pipe.close()

    other = dict(case, schedule=case["resume_schedule"], chunks=case["chunks"] * mesh.size(0))
    model = getattr(models, case["model"])(seed=1)
    pipe = _pipe(other, model)  # the world: one pipeline of every rank
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(pipe, opt, options=FLAT)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    set_state_dict(pipe, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=FLAT)
    loaded = {n: t.clone() for n, t in pipe.state_dict().items()}
    resumed = _train(other, mesh, model, pipe, range(saved_at, len(batches)), batches, opt)
    return {"before": before, "after": after, "resumed": resumed, "saved": mine, "loaded": loaded}


if __name__ == "__main__":
    rank_, world_, init_, cases_path, out = sys.argv[1:]
    run(int(rank_), int(world_), init_, torch.load(cases_path, weights_only=False), out)
