"""The planner against reality: predicted vs measured step time on 2 gloo ranks.

Both ranks profile the pipelining benchmark's compute-bound model at the same
time (so the profile sees the same two-process contention as the pipeline),
and measure the gloo latency of a small message. Rank 0 plans over a small
grid (schedules × chunks, no checkpointing); then every candidate of the
grid runs for real, in rounds (each round times every candidate over three
steps; the figure is the median over rounds), over gloo (``shm=False``):
the link figures given to the planner are gloo's. The report gives, for the
chosen plan, predicted / measured, and the chosen plan's measured time
against the fastest measured.

    python -m bench plan [--repeats N]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from bench._runner import round_robin_medians, spawn
from bench._workloads import WORKLOADS

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


def _transfer_cost(rank: int, width: int, rows: int, rounds: int = 50) -> float:
    """Seconds a rank's thread spends per message of a boundary's size: pack and
    isend on one end, wait and unpack on the other (fastpipe's own path).

    Each message follows a few milliseconds of compute, as in a pipeline: on
    a machine with one core per rank, an isend issued from a busy rank costs
    its thread about 4x what it costs in an idle ping-pong (the gloo thread
    that moves the bytes takes the core; measured 0.31 ms against 0.07 ms).
    The receiver computes twice as long, so its message has arrived and only
    the wait's bookkeeping and the unpack are timed."""
    from fastpipe import pack, unpack

    x = torch.randn(rows, width)
    flat, layout = pack([x])
    a, w = torch.randn(rows, 4 * width), torch.randn(4 * width, 4 * width)
    dist.barrier()
    spent, works = 0.0, []
    for i in range(rounds + 5):
        for _ in range(3 if rank == 0 else 6):
            a @ w
        t0 = time.perf_counter()
        if rank == 0:
            buf, _ = pack([x], out=flat)
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


def _rank_main(rank, world, init, queue, repeats):
    from fastpipe import Pipe, plan
    from fastpipe.balance import profile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    w = WORKLOADS["mlp-compute"]
    width, blocks, batch = w.sizes["width"], w.sizes["blocks"], w.batch
    model = w.build()
    x, y = w.data()
    try:
        latency = _latency(rank)
        transfer = _transfer_cost(rank, width, batch // 8)
        dist.barrier()
        prof = profile(model, x, chunks=max(GRID_CHUNKS), fit_rows=batch // min(GRID_CHUNKS),
                       window=-(-blocks // world))
        box = [None]
        if rank == 0:
            box = [plan(model, x, world, schedules=GRID_SCHEDULES, chunks=GRID_CHUNKS,
                        checkpoints=["never"], latency=latency, transfer_cost=transfer,
                        prof=prof)]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
        # Round robin: every candidate is timed in each round, so a slow spell
        # of the machine falls on all of them instead of on a few.
        pipes = {(c.schedule, c.chunks): Pipe(
            w.build(), chunks=c.chunks, schedule=c.order if c.order is not None else c.schedule,
            balance=list(c.balance), stages_per_rank=c.stages_per_rank, shm=False)
            for c in result.candidates}
        measured = round_robin_medians(
            {key: functools.partial(pipe.step, x, y, nn.functional.mse_loss) for key, pipe in pipes.items()},
            1, repeats, dist.barrier, per_round=3)
        for pipe in pipes.values():
            pipe.close()
    finally:
        dist.destroy_process_group()
    queue.put((rank, (result, measured, latency, transfer)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench plan", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    result, measured, latency, transfer = spawn(2, _rank_main, args.repeats)[0]
    print(f"plan vs measured, compute-bound model, 2 gloo ranks: gloo latency {latency * 1e6:.0f} us, "
          f"{transfer * 1e6:.0f} us per message end on the compute thread")
    print(f"  {'schedule':<18}{'chunks':>7}{'predicted ms':>14}{'measured ms':>13}{'pred/meas':>11}")
    for c in result.candidates:
        m = measured[(c.schedule, c.chunks)]
        mark = "*" if c == result.best else " "
        print(f"{mark} {c.schedule:<18}{c.chunks:>7}{c.step_seconds * 1e3:>14.1f}{m * 1e3:>13.1f}"
              f"{c.step_seconds / m:>11.2f}")
    chosen = measured[(result.best.schedule, result.best.chunks)]
    fastest = min(measured.values())
    errors = [abs(c.step_seconds / measured[(c.schedule, c.chunks)] - 1) for c in result.candidates]
    print(f"  chosen: predicted/measured {result.best.step_seconds / chosen:.2f} (target within 15 %); "
          f"chosen/fastest measured {chosen / fastest:.3f} (target <= 1.05); "
          f"median |error| over the grid {statistics.median(errors):.0%}")
    return 0
