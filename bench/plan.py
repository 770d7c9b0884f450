"""The planner against reality: predicted vs measured step time on 2 gloo ranks.

Both ranks profile a workload of the pipelining benchmarks (``--workload``:
the GPT first, compute- and overhead-bound, then the MLP) at the same time
(so the profile sees the same two-process contention as the pipeline),
and measure the gloo latency of a small message. Rank 0 plans over a small
grid (schedules × chunks, no checkpointing); then every candidate of the
grid runs for real, in rounds (each round times every candidate over three
steps; the figure is the median over rounds), over gloo (``shm=False``):
the link figures given to the planner are gloo's. The report gives, for the
chosen plan, predicted / measured, and the chosen plan's measured time
against the fastest measured.

    python -m bench plan [--workload gpt-compute,gpt-overhead,mlp-compute] [--repeats N]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist

from bench._runner import round_robin_medians, spawn
from bench._workloads import workload
from fastpipe._microbatch import flatten

GRID_SCHEDULES = ["1f1b", "zb-h1", "interleaved-1f1b", "zbv"]
GRID_CHUNKS = [4, 8, 16]


def _latency(rank: int, rounds: int = 50) -> float:
    """Seconds one small gloo message takes (half a round trip)."""
    buf = torch.zeros(64, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    return (time.perf_counter() - t0) / rounds / 2


def _transfer_cost(rank: int, boundary: list[torch.Tensor], rounds: int = 50) -> float:
    """Seconds a rank's thread spends per message of a boundary's size: pack and
    isend on one end, wait and unpack on the other (fastpipe's own path).

    Each message follows a few milliseconds of compute, as in a pipeline: on
    a machine with one core per rank, an isend issued from a busy rank costs
    its thread about 4x what it costs in an idle ping-pong (the gloo thread
    that moves the bytes takes the core; measured 0.31 ms against 0.07 ms).
    The receiver computes twice as long, so its message has arrived and only
    the wait's bookkeeping and the unpack are timed."""
    from fastpipe import pack, unpack

    xs = [torch.randn_like(t) if t.is_floating_point() else t.clone() for t in boundary]
    flat, layout = pack(xs)
    x = max(xs, key=torch.Tensor.numel)  # the compute between messages: the boundary's width
    width = x.shape[-1]
    a, w = torch.randn(x.numel() // width, 4 * width), torch.randn(4 * width, 4 * width)
    dist.barrier()
    spent, works = 0.0, []
    for i in range(rounds + 5):
        for _ in range(3 if rank == 0 else 6):
            a @ w
        t0 = time.perf_counter()
        if rank == 0:
            buf, _ = pack(xs, out=flat)
            works.append(dist.isend(buf, 1))
        else:
            work = dist.irecv(flat, 0)
            work.wait()
            unpack(flat, layout)
        if i >= 5:
            spent += time.perf_counter() - t0
    for work in works:
        work.wait()
    total = torch.tensor([spent / rounds])
    dist.all_reduce(total)
    return total.item() / 2


def _rank_main(rank, world, init, queue, name, repeats):
    from fastpipe import Pipe, plan
    from fastpipe.balance import profile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    w = workload(name)
    model = w.build()
    x, y = w.data()
    chunks = [c for c in GRID_CHUNKS if c <= w.batch]
    try:
        latency = _latency(rank)
        with torch.no_grad():  # what crosses a boundary at the chunks the workload runs
            boundary, _ = flatten(model[0](x[: w.batch // w.chunks]))
        transfer = _transfer_cost(rank, boundary)
        dist.barrier()
        prof = profile(model, x, chunks=max(chunks), fit_rows=w.batch // min(chunks),
                       window=-(-len(model) // world), loss_fn=w.loss_fn, target=y)
        box = [None]
        if rank == 0:
            box = [plan(model, x, world, schedules=GRID_SCHEDULES, chunks=chunks,
                        checkpoints=["never"], latency=latency, transfer_cost=transfer,
                        prof=prof, loss_fn=w.loss_fn, target=y)]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
        # Round robin: every candidate is timed in each round, so a slow spell
        # of the machine falls on all of them instead of on a few.
        # By place in the list: a schedule and chunk count can come as
        # several candidates (its lean orders, its checkpointing).
        pipes = {i: Pipe(
            w.build(), chunks=c.chunks, schedule=c.order if c.order is not None else c.schedule,
            balance=list(c.balance), stages_per_rank=c.stages_per_rank, shm=False)
            for i, c in enumerate(result.candidates)}
        measured = round_robin_medians(
            {key: functools.partial(pipe.step, x, y, w.loss_fn) for key, pipe in pipes.items()},
            1, repeats, dist.barrier, per_round=3)
        for pipe in pipes.values():
            pipe.close()
    finally:
        dist.destroy_process_group()
    queue.put((rank, (result, measured, latency, transfer)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench plan", description=__doc__)
    parser.add_argument("--workload", default="gpt-compute,gpt-overhead,mlp-compute",
                        help="workload names (bench._workloads), comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    for name in args.workload.split(","):
        try:
            workload(name)
        except (KeyError, ValueError):
            parser.error(f"unknown workload {name!r} (bench._workloads.WORKLOADS)")
    for name in args.workload.split(","):
        _report(name, *spawn(2, _rank_main, name, args.repeats)[0])
    return 0


def _report(name, result, measured, latency, transfer) -> None:
    print(f"\nplan vs measured, {name} ({workload(name).describe()}), 2 gloo ranks: gloo "
          f"latency {latency * 1e6:.0f} us, {transfer * 1e6:.0f} us per message end on the compute "
          "thread")
    print(f"  {'schedule':<18}{'chunks':>7}{'predicted ms':>14}{'measured ms':>13}{'pred/meas':>11}")
    for i, c in enumerate(result.candidates):
        m = measured[i]
        mark = "*" if c == result.best else " "
        name = c.schedule + (" lean/bytes" if c.sized else " lean" if c.lean
                             else "~" if c.order is not None else "")
        print(f"{mark} {name:<18}{c.chunks:>7}{c.step_seconds * 1e3:>14.1f}{m * 1e3:>13.1f}"
              f"{c.step_seconds / m:>11.2f}  {list(c.balance)}")
    chosen = measured[result.candidates.index(result.best)]
    fastest = min(measured.values())
    errors = [abs(c.step_seconds / measured[i] - 1) for i, c in enumerate(result.candidates)]
    print(f"  chosen: predicted/measured {result.best.step_seconds / chosen:.2f} (target within 15 %); "
          f"chosen/fastest measured {chosen / fastest:.3f} (target <= 1.05); "
          f"median |error| over the grid {statistics.median(errors):.0%}")
