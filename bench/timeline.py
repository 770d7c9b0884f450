"""Where a step's time goes: each rank's actions, measured.

Two gloo ranks on 127.0.0.1, one intra-op thread each (``--local``: two
ranks as threads of one process), the workload, split and orders of
``python -m bench pipelining``. After the warm-up, every step runs
through ``Pipe.step_with_timeline``; the report gives, per schedule and rank,
the median over the recorded steps (``--repeats``) of the step's span and of
the rank's time computing (busy), waiting for data, in sends, in the rest
until its last action (the executor's own Python: posting receives,
bookkeeping, unpacking), and idle after it; then each action kind's count and
median duration. ``--trace DIR``
writes the last recorded step of each schedule as a Chrome trace
(``chrome://tracing`` / Perfetto).

    python -m bench timeline [--model gpt] [--workload compute|overhead] [--local]
                             [--schedules 1f1b,zb-h2] [--repeats N] [--trace DIR]
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from bench._runner import spawn, workload_parser
from bench._workloads import selected, workload
from bench.pipelining import SCHEDULES, TWO_STAGES, balance, describe_orders, order

_COMPUTE = ("F", "B", "I", "W")
_FIGURES = ("span", "busy", "wait", "send", "other", "after")


def _summary(sim, rank: int) -> dict[str, float]:
    """One step's figures for ``rank`` (milliseconds from the step's start)."""
    mine = [r for r in sim.timeline if r.rank == rank]
    compute = [r for r in mine if r.track == "compute"]
    comm = [r for r in mine if r.track == "comm"]
    end = max(r.end for r in compute)
    out = {"span": sim.makespan, "busy": sim.busy[rank],
           "wait": sum(r.end - r.start for r in comm if r.action.kind.name.startswith("RECV")),
           "send": sum(r.end - r.start for r in comm if r.action.kind.name.startswith("SEND")),
           "after": sim.makespan - end}
    # Until its last action, a rank not computing, waiting or sending runs the
    # executor's own Python (posting receives, bookkeeping, message handling).
    out["other"] = end - out["busy"] - out["wait"] - out["send"]
    per_kind: dict[str, list[float]] = defaultdict(list)
    for r in compute:
        per_kind[r.action.kind.name].append(r.end - r.start)
    for kind, times in per_kind.items():
        out[f"{kind} n"] = len(times)
        out[f"{kind} ms"] = statistics.median(times)
    return out


def _record(w, schedule: str, bal, runs, warmup: int, steps: int, trace: str | None, **where) -> list:
    """``steps`` recorded steps of ``schedule`` (run as ``runs``: its name,
    which a zero-bubble Pipe reorders after its second step, or the built-in
    list) after ``warmup`` plain ones."""
    from fastpipe import Pipe

    x, y = w.data()
    spr = 2 if schedule in TWO_STAGES else None
    pipe = Pipe(w.build(), chunks=w.chunks, schedule=runs, balance=bal, stages_per_rank=spr, **where)
    try:
        for _ in range(warmup):
            pipe.step(x, y, w.loss_fn)
        sims = [pipe.step_with_timeline(x, y, w.loss_fn)[1] for _ in range(steps)]
    finally:
        pipe.close()
    if trace is not None and (not pipe.distributed or pipe.rank == 0):
        mode = "local" if not pipe.distributed else "dist"
        sims[-1].to_chrome_trace(Path(trace) / f"{w.name}-{schedule}-{mode}.json")
    return [[_summary(s, r) for s in sims] for r in range(pipe.schedule.ranks)]


def _rank_main(rank, world, init, queue, name, balances, orders, warmup, steps, trace):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    w = workload(name)
    try:
        results = {s: _record(w, s, bal, orders[s], warmup, steps, trace) for s, bal in balances.items()}
    finally:
        dist.destroy_process_group()
    queue.put((rank, results))


def _median(steps: list[dict[str, float]], key: str) -> float:
    return statistics.median(s.get(key, 0.0) for s in steps)


def run(w, schedules: list[str], warmup: int, steps: int, trace: str | None, ranks: int = 2,
        by_cost: bool = True, local: bool = False) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if trace is not None:
        Path(trace).mkdir(parents=True, exist_ok=True)
    balances = {s: balance(w, s, ranks) for s in schedules}
    orders = {s: order(w, s, balances[s], ranks, by_cost) for s in schedules}
    if local:
        torch.set_num_threads(1)
        results = {s: _record(w, s, bal, orders[s], warmup, steps, trace, devices=["cpu"] * ranks)
                   for s, bal in balances.items()}
        how = f"local mode, {ranks} cpu devices"
    else:
        results = spawn(ranks, _rank_main, w.name, balances, orders, warmup, steps, trace)[0]
        how = f"{ranks} gloo ranks"
    print(f"\n{w.name}: {w.describe()}, {how} x 1 thread; medians of {steps} steps, ms")
    print(describe_orders(orders))
    kinds = [k for k in _COMPUTE if any(f"{k} n" in s for per in results.values() for r in per for s in r)]
    head = "".join(f"{k + ' n':>6}{k + ' ms':>8}" for k in kinds)
    print(f"  {'schedule':<18}{'rank':>5}" + "".join(f"{k:>8}" for k in _FIGURES) + head)
    for schedule in schedules:
        for rank, per_step in enumerate(results[schedule]):
            figures = "".join(f"{_median(per_step, k):>8.2f}" for k in _FIGURES)
            cells = "".join(f"{_median(per_step, k + ' n'):>6.0f}{_median(per_step, k + ' ms'):>8.3f}"
                            for k in kinds)
            print(f"  {schedule if rank == 0 else '':<18}{rank:>5}{figures}{cells}")


def main(argv=None) -> int:
    parser = workload_parser("python -m bench timeline", __doc__, SCHEDULES)
    parser.add_argument("--trace", default=None, help="a folder for each schedule's Chrome trace")
    parser.add_argument("--local", action="store_true",
                        help="local mode: the ranks as threads of this process (as bench local)")
    args = parser.parse_args(argv)
    for w in selected(args):
        run(w, args.schedules.split(","), args.warmup, args.repeats, args.trace,
            by_cost=not args.built_in_order, local=args.local)
    return 0
