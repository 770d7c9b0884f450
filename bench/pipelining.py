"""fastpipe vs torch.distributed.pipelining: same model, microbatches, schedules.

Two gloo ranks on 127.0.0.1, one intra-op thread each. For every schedule
both libraries run in the same processes, in turns (a few steps of each,
round after round, so a slow spell of the machine falls on all), and the
report gives each one's median step time, their ratio, and efficiency =
(sequential fwd+bwd of all microbatches ÷ ranks) / step time. fastpipe runs
three times: with its default on CPUs (transfers inline on the compute
thread, through shared-memory rings since both ranks share this host:
``Pipe(shm=None)``), with the same inline transfers through gloo
(``shm=False``), and with its communication lanes over gloo
(``overlap=True``); "gloo/default" and "lanes/default" are what those
change. First each rank runs its share of the layers alone, both at once,
with no messages: the machine's ceiling for any pipeline on these ranks.

With ``--fused-wgrad`` fastpipe also runs with ``Pipe(fused_wgrad=True)``
(each Linear's weight gradient accumulated by one GEMM into ``.grad``): its
"fused" column's efficiency is taken against a sequential baseline that
does the same (the model as one stage of a one-rank fused Pipe), since the
work itself is cheaper; torch/fused is plain throughput.

The workloads (``bench._workloads``): a GPT first, then the MLP stack, each
compute-bound and overhead-bound; both libraries get the same layers per
stage: the measured layer times split as ``Pipe(balance="auto")`` splits
them (``Workload.balance``; the report prints it).

    python -m bench pipelining [--model gpt|mlp|both] [--workload compute|overhead|both]
                               [--repeats N] [--fused-wgrad]
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
import torch.distributed as dist
from torch import nn

from bench._runner import median_time, round_robin_medians, spawn, workload_parser
from bench._workloads import WORKLOADS, Workload, selected

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2", "zbv", "dualpipev"]
TWO_STAGES = {"interleaved-1f1b", "looped-bfs", "zbv", "dualpipev"}
V_SHAPED = {"zbv", "dualpipev"}


def balance(w: Workload, schedule: str, ranks: int = 2) -> list[int]:
    """The split both libraries run for ``schedule`` (``Workload.balance``)."""
    from fastpipe.schedules import build

    spr = 2 if schedule in TWO_STAGES else 1
    return w.balance(build(schedule, ranks, w.chunks, stages_per_rank=spr))


def _torch_stage_ids(schedule: str, rank: int, ranks: int) -> list[int]:
    if schedule in V_SHAPED:
        return [rank, 2 * ranks - 1 - rank]
    if schedule in TWO_STAGES:
        return [rank, rank + ranks]
    return [rank]


def _torch_runner(schedule, model, rank, ranks, chunks, loss_fn, bal):
    from torch.distributed import pipelining as pp

    classes = {
        "gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
        "interleaved-1f1b": pp.ScheduleInterleaved1F1B, "looped-bfs": pp.ScheduleLoopedBFS,
        "zbv": pp.ScheduleZBVZeroBubble, "dualpipev": pp.schedules.ScheduleDualPipeV,
        # torch has no ZB-H1/H2 for one stage per rank; its interleaved zero-bubble
        # schedule over one stage per rank is the closest peer.
        "zb-h1": pp.ScheduleInterleavedZeroBubble, "zb-h2": pp.ScheduleInterleavedZeroBubble,
    }
    ids = _torch_stage_ids(schedule, rank, ranks)
    n_stages = ranks * len(ids)
    bounds = [0, *itertools.accumulate(bal)]
    stages = [
        pp.PipelineStage(model[bounds[s] : bounds[s + 1]], s, n_stages, torch.device("cpu"))
        for s in ids
    ]
    cls = classes[schedule]
    single = cls in (pp.ScheduleGPipe, pp.Schedule1F1B)
    sched = cls(stages[0] if single else stages, n_microbatches=chunks, loss_fn=loss_fn)
    has_first, has_last = 0 in ids, n_stages - 1 in ids

    def step(x, y):
        args = (x,) if has_first else ()
        kwargs = {"target": y, "losses": []} if has_last else {}
        sched.step(*args, **kwargs)

    return step


def _alone_time(w: Workload, rank, world, warmup, repeats, bal) -> float:
    """Each rank runs its share of the layers over every microbatch with no
    messages and no dependencies, at the same time as the other ranks: the
    machine's own ceiling for the ranks side by side (shared caches, memory
    bandwidth, one core each), which a pipeline's bubble and transfers only
    lower. A rank's input is what its first layer gets in the real model."""
    model = w.build()
    bounds = [0, *itertools.accumulate(bal)]
    part = model[bounds[rank] : bounds[rank + 1]]
    x, _ = w.data()
    with torch.no_grad():
        x = model[: bounds[rank]](x)
    xs = x.tensor_split(w.chunks)

    def step():
        for x in xs:
            part(x).float().square().mean().backward()

    return round_robin_medians({"alone": step}, warmup, max(1, repeats // 3), dist.barrier,
                               per_round=3)["alone"]


def _rank_main(rank, world, init, queue, name, balances, ceiling, warmup, repeats, fused=False):
    from fastpipe import Pipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    w = WORKLOADS[name]
    chunks, loss_fn = w.chunks, w.loss_fn
    x, y = w.data()
    rows = {}
    try:
        rows["alone"] = _alone_time(w, rank, world, warmup, repeats, ceiling)
        for schedule, bal in balances.items():
            spr = 2 if schedule in TWO_STAGES else None
            pipes = [Pipe(w.build(), chunks=chunks, schedule=schedule, balance=bal,
                          stages_per_rank=spr, overlap=overlap, shm=shm)
                     for overlap, shm in ((False, None), (False, False), (True, None))]
            runners = {name: functools.partial(pipe.step, x, y, loss_fn)
                       for name, pipe in zip(("ours", "gloo", "lanes"), pipes)}
            if fused:
                pipes.append(Pipe(w.build(), chunks=chunks, schedule=schedule, balance=bal,
                                  stages_per_rank=spr, fused_wgrad=True))
                runners["fused"] = functools.partial(pipes[-1].step, x, y, loss_fn)
            theirs = None
            try:
                runners["theirs"] = functools.partial(
                    _torch_runner(schedule, w.build(), rank, world, chunks, loss_fn, bal), x, y)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
                theirs = f"n/a ({type(exc).__name__})"
            # In turns (three steps each per round), so a slow spell of the
            # machine falls on all three rather than on one.
            times = round_robin_medians(runners, warmup, max(1, repeats // 3), dist.barrier, per_round=3)
            for pipe in pipes:
                pipe.close()
            rows[schedule] = (times["ours"], times["gloo"], times["lanes"],
                              times.get("theirs", theirs), times.get("fused"))
    finally:
        dist.destroy_process_group()
    queue.put((rank, rows))


def fused_sequential_step(w: Workload):
    """``sequential_step`` with fused weight gradients: the model as the one
    stage of a one-rank Pipe (local mode, so no process group is needed).
    Returns the Pipe (to close) and the step. A plain one-rank Pipe measured
    against ``sequential_step``: the same time on the wide model, 2-5 %
    slower on the narrow one (its executor's own work), which flatters the
    narrow fused rows' efficiency by as much."""
    from fastpipe import Pipe

    pipe = Pipe(w.build(), chunks=w.chunks, schedule="gpipe", devices=["cpu"], fused_wgrad=True)
    x, y = w.data()
    return pipe, functools.partial(pipe.step, x, y, w.loss_fn)


def _fused_sequential_time(w: Workload, warmup, repeats) -> float:
    pipe, step = fused_sequential_step(w)
    try:
        return median_time(step, warmup, repeats, lambda: None)
    finally:
        pipe.close()


def run(w: Workload, repeats: int, warmup: int, schedules: list[str], ranks: int = 2,
        fused: bool = False) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    seq = median_time(w.sequential_step(), warmup, repeats, lambda: None)
    seq_fused = _fused_sequential_time(w, warmup, repeats) if fused else None
    balances = {s: balance(w, s, ranks) for s in schedules}
    ceiling = balance(w, "1f1b", ranks)  # one stage per rank
    rows = spawn(ranks, _rank_main, w.name, balances, ceiling, warmup, repeats, fused)[0]
    ideal = seq / ranks
    alone = rows.pop("alone")
    print(f"\n{w.name}: {w.describe()}, {ranks} gloo ranks x 1 thread; "
          f"sequential fwd+bwd {seq * 1e3:.1f} ms")
    print(f"  each rank its layers alone, no pipeline (the two-rank ceiling) {alone * 1e3:.1f} ms, "
          f"efficiency {ideal / alone:.2f}")
    print("  layers per stage (both libraries): " + ", ".join(
        f"{s} {balances[s]}" for s in schedules))
    if seq_fused is not None:
        print(f"  sequential with fused weight gradients (one-rank Pipe) {seq_fused * 1e3:.1f} ms: "
              "the baseline of 'eff fused'")
    fused_head = f"{'fused ms':>10}{'torch/fused':>13}{'eff fused':>11}" if fused else ""
    print(f"  {'schedule':<18}{'fastpipe ms':>12}{'gloo ms':>9}{'lanes ms':>10}{'torch ms':>10}"
          f"{'torch/fastpipe':>16}{'gloo/default':>14}{'lanes/default':>15}{'eff fastpipe':>14}"
          f"{'eff torch':>11}{fused_head}")
    for schedule, (ours, gloo, lanes, theirs, ours_fused) in rows.items():
        head = f"  {schedule:<18}{ours * 1e3:>12.1f}{gloo * 1e3:>9.1f}{lanes * 1e3:>10.1f}"
        tail = ""
        if ours_fused is not None:
            vs = f"{theirs / ours_fused:>13.2f}" if not isinstance(theirs, str) else f"{'':>13}"
            tail = f"{ours_fused * 1e3:>10.1f}{vs}{seq_fused / ranks / ours_fused:>11.2f}"
        if isinstance(theirs, str):
            print(f"{head}{theirs:>10}{'':>16}{gloo / ours:>14.2f}{lanes / ours:>15.2f}"
                  f"{ideal / ours:>14.2f}{'':>11}{tail}")
            continue
        print(f"{head}{theirs * 1e3:>10.1f}{theirs / ours:>16.2f}{gloo / ours:>14.2f}"
              f"{lanes / ours:>15.2f}{ideal / ours:>14.2f}{ideal / theirs:>11.2f}{tail}")


def main(argv=None) -> int:
    parser = workload_parser("python -m bench pipelining", __doc__, SCHEDULES)
    parser.add_argument("--fused-wgrad", action="store_true",
                        help="also run fastpipe with Pipe(fused_wgrad=True)")
    args = parser.parse_args(argv)
    for w in selected(args):
        run(w, args.repeats, args.warmup, args.schedules.split(","), fused=args.fused_wgrad)
    return 0
