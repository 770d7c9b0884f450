"""Body of the spawned gloo ranks of test_pipe_distributed (one file per rank)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from tests.support import heap_in_use, rank_results

SPR = {"interleaved-1f1b": 2, "looped-bfs": 2, "zbv": 2, "dualpipev": 2}


def run(rank: int, world: int, init: str, cases: list[dict], out_path: str) -> None:
    from fastpipe import Pipe
    from fastpipe.runtime import shm as shm_mod
    from fastpipe.runtime.transport.groups import _FLOW_GROUPS
    from tests import models

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    counts = _count_p2p()
    capacity = shm_mod.CAPACITY
    pairs = None
    with rank_results(out_path) as results:
        for case in cases:
            if case.get("train"):
                results.append(_train(case))
                continue
            if case.get("soak"):
                results.append(_soak(case))
                continue
            if case.get("scaler"):
                results.append(_scaler(case))
                continue
            group = None
            if case.get("pairs"):  # two pipelines side by side: ranks (0, 1) and (2, 3)
                if pairs is None:  # every rank makes every subgroup, in the same order
                    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
                group = pairs[rank // 2]
            with torch.device("meta") if case.get("meta") else contextlib.nullcontext():
                model = getattr(models, case["model"])()
            # balance="auto" sees W at a quarter of F (made up, so the order it picks is certain).
            restore = _profile_cheap_w() if case.get("cheap_w") else (lambda: None)
            seen = []  # forced_order: what the reorder after the second step was given
            if case.get("forced_order"):
                restore = _force_order(seen)
            # NCCL's message rules (exact sizes, order not tags), on gloo; inline only.
            os.environ["FASTPIPE_EXACT_MESSAGES"] = "1" if case.get("exact") else "0"
            shm_mod.CAPACITY = case.get("shm_capacity", capacity)
            pipe = Pipe(model, chunks=case["chunks"], schedule=case["schedule"], group=group,
                        balance=case.get("balance"), stages_per_rank=SPR.get(case["schedule"]),
                        timeout=60, overlap=case.get("overlap", not case.get("exact")),
                        checkpoint=case.get("checkpoint", "never"),
                        wire_dtype=case.get("wire"), grad_wire_dtype=case.get("grad_wire"),
                        shm=case.get("shm", False), free_remote=case.get("free_remote", False),
                        **({"fused_wgrad": case["fused"]} if "fused" in case else {}))
            assert pipe.shm == bool(case.get("shm")), "the shared-memory path was not taken"
            assert pipe.fused_wgrad is case.get("fused", True), "B defers by default"
            loss_fn = models.loss_of(case)
            unwritten = partly = None
            if case.get("meta"):  # built on meta: refused until written, then given the seeded values
                try:
                    pipe.step(*case["batches"][0], loss_fn)
                except ValueError as exc:
                    unwritten = str(exc)
                if rank == 0:  # rank 0 alone written: every rank must still refuse
                    pipe.load_state_dict(getattr(models, case["model"])().state_dict())
                try:
                    pipe.step(*case["batches"][0], loss_fn)
                except ValueError as exc:
                    partly = str(exc)
                pipe.load_state_dict(getattr(models, case["model"])().state_dict())
            losses, outs, rings, p2p, input_grads = [], [], [], [], []
            del _SIZES[:]
            for x, y in case["batches"]:
                counts.clear()
                if case.get("input_grad"):  # every rank passes x; stage 0's gets its .grad
                    x = x.clone().requires_grad_()
                if case.get("amp"):  # the step under CPU bf16 autocast, float32 data
                    x, y = (t.float() if t.is_floating_point() else t for t in (x, y))
                with _amp(case):
                    losses.append(pipe.step(x, y, loss_fn))
                p2p.append(dict(counts))
                rings.append(_ring_stats(pipe))
                with torch.no_grad(), _amp(case):
                    outs.append(pipe(x))
                input_grads.append(x.grad if isinstance(x, torch.Tensor) else None)
            norm = pipe.clip_grad_norm_(case["clip"], case.get("norm_type", 2.0)) if case.get("clip") else None
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            meta = sorted(n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta)
            refused = None
            if case.get("refit"):  # a second Pipe over the released model, split another way
                try:
                    Pipe(model, chunks=case["chunks"], schedule=case["schedule"], group=group,
                         balance=case["refit"], timeout=60, shm=False)
                except ValueError as exc:
                    refused = str(exc)
            results.append({"losses": losses, "grads": grads, "outs": outs, "rings": rings, "p2p": p2p,
                            "input_grads": input_grads, "norm": norm, "order": pipe.schedule.actions,
                            "meta": meta, "refused": refused, "unwritten": unwritten, "partly": partly,
                            "flow_groups": len(_FLOW_GROUPS), "sizes": list(_SIZES),
                            "staged": pipe._runner.shm_link[0].staged_total if pipe.shm else 0,
                            "measured": seen})
            restore()


def _profile_cheap_w():
    """Makes ``fastpipe.balance.profile`` report W at a quarter of F; returns the undo."""
    import fastpipe.balance as balance_mod
    from fastpipe.balance import LayerProfile, Profile

    def cheap_w(model, sample, device="cpu", chunks=1, **_):
        layer = LayerProfile(1e-3, 1.25e-3, 1e-3, 0.25e-3, 100, 100, 100)
        return Profile(tuple(layer for _ in model), 1, "cpu")

    real, balance_mod.profile = balance_mod.profile, cheap_w
    return lambda: setattr(balance_mod, "profile", real)


def _force_order(seen: list):
    """Makes the Pipe's reorder after a measured step take the zero-bubble
    order for W at a quarter of F (so the order it runs next is certain) and
    keeps the seconds it was given in ``seen``; returns the undo."""
    import fastpipe._plan as plan_mod
    from fastpipe.schedules import build

    real = plan_mod.order_measured

    def forced(schedule, seconds):
        seen.append(dict(seconds))
        return build(schedule.name, schedule.ranks, schedule.microbatches,
                     schedule.stages // schedule.ranks, costs={"F": 1.0, "I": 1.0, "W": 0.25})

    plan_mod.order_measured = forced
    return lambda: setattr(plan_mod, "order_measured", real)


def _amp(case: dict):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(case.get("amp")))


_SIZES: list = []  # (op, this rank, peer, tag, bytes) of every isend/irecv of a case


def _count_p2p() -> dict:
    """Counts isend/irecv calls from here on (the worker's own process): by kind
    ("isend"), and by kind and the flow group they used ("isend up")."""
    from fastpipe.runtime.transport.groups import _FLOW_GROUPS, _LATE_GROUPS  # read only

    counts: dict = {}
    for name in ("isend", "irecv"):
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            by_group = {id(g): prefix + d for prefix, cache in (("", _FLOW_GROUPS), ("late ", _LATE_GROUPS))
                        for made in cache.values() for d, g in made.items()}
            where = f"{_name} {by_group.get(id(kwargs.get('group')), 'other')}"
            counts[where] = counts.get(where, 0) + 1
            peer = kwargs.get("dst", kwargs.get("src"))
            tensor = args[0] if args else kwargs["tensor"]
            group = by_group.get(id(kwargs.get("group")), "other")
            _SIZES.append((_name, dist.get_rank(), peer, (group, kwargs.get("tag")),
                           tensor.numel() * tensor.element_size()))
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def _train(case: dict) -> dict:
    """Adam on the demo model for case["steps"] steps; returns the losses."""
    from fastpipe import Pipe
    from fastpipe._demo import _data, _model

    torch.manual_seed(0)
    model = _model()
    pipe = Pipe(model, chunks=4, schedule=case["schedule"], timeout=60,
                wire_dtype=case.get("wire"), grad_wire_dtype=case.get("grad_wire"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(case["steps"]):
        x, y = _data(step, case["batch"])
        opt.zero_grad()
        losses.append(pipe.step(x, y, nn.functional.mse_loss).item())
        opt.step()
    return {"losses": losses}


def _scaler(case: dict) -> dict:
    """step(scaler=) with a ShardedGradScaler: the step's loss and this rank's
    gradients; then rank 0 finds an inf, and every rank must skip the
    optimizer step and halve its scale. A plain GradScaler is refused."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fastpipe import Pipe
    from tests import models

    model = models.mlp(depth=8)
    pipe = Pipe(model, chunks=4, schedule=case["scaler"], stages_per_rank=SPR.get(case["scaler"]),
                timeout=60)
    x, y = case["batch"]
    try:
        pipe.step(x, y, nn.functional.mse_loss, scaler=torch.amp.GradScaler("cpu"))
    except TypeError as exc:
        refused = str(exc)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    loss = pipe.step(x, y, nn.functional.mse_loss, scaler=scaler)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if dist.get_rank() == 0:
        next(iter(pipe.parameters())).grad.view(-1)[0] = float("inf")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    scaler.step(opt)
    scaler.update()
    stepped = any(not torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
    pipe.close()
    return {"loss": loss, "grads": grads, "scale": scaler.get_scale(), "stepped": stepped,
            "refused": refused}


def _resources() -> dict:
    """What a leak would grow: memory, threads, file descriptors, live tensors and objects."""
    import gc
    import os
    import threading
    import warnings

    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {
        "rss": rss,
        "heap": heap_in_use(),
        "threads": len(os.listdir("/proc/self/task")),
        "py_threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "tensors": _live_tensors(gc, warnings),
        "objects": len(gc.get_objects()),
    }


def _live_tensors(gc, warnings) -> int:
    with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _soak(case: dict) -> dict:
    """case["steps"] Adam steps of the demo model; resources every case["every"] steps."""
    from fastpipe import Pipe
    from fastpipe._demo import _data, _model

    torch.manual_seed(0)
    model = _model()
    pipe = Pipe(model, chunks=4, schedule=case["schedule"], timeout=60)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    marks = {}
    for step in range(case["steps"]):
        x, y = _data(step % 10, case["batch"])
        opt.zero_grad()
        pipe.step(x, y, nn.functional.mse_loss)
        opt.step()
        if (step + 1) % case["every"] == 0:
            marks[step + 1] = _resources()
    return {"marks": marks}


def _ring_stats(pipe) -> dict:
    """After a training step: buffer-ring sizes, allocations, slots still held, planned sizes."""
    from fastpipe.runtime.buffers import receive_slots

    rings = pipe._runner.transport.rings()
    return {
        "recv_size": {s: r.size for s, r in rings["recv"].items()},
        "planned": receive_slots(pipe._lowered.actions[pipe.rank]),
        "send_size": {s: r.size for s, r in rings["send"].items()},
        "recv_allocations": sum(r.allocations for r in rings["recv"].values()),
        "held": sum(r.held for kind in rings.values() for r in kind.values()),
    }


if __name__ == "__main__":
    rank, world, init, cases_path, out = sys.argv[1:]
    run(int(rank), int(world), init, torch.load(cases_path, weights_only=False), out)
