"""What a step holds: ``Pipe.memory_stats()``'s activation peak against the heap's.

Two gloo ranks on 127.0.0.1, one intra-op thread each, the workload, split
and orders of ``python -m bench pipelining``. After warm-up steps, each
measured step samples glibc's bytes in use (``mallinfo2``: small blocks and
mmapped ones) after every action of the rank's list; the step's growth is
its highest sample less the sample before it, and the report gives, per
schedule and rank, the least growth over ``--repeats`` steps (the
allocator's own noise only adds) next to the activation peak the executor
booked. They should agree: what the executor books is what the planner walks
(``fastpipe.plan``) and what a user sizes a memory limit by.

    python -m bench memory [--model gpt] [--workload compute|overhead]
                           [--schedules 1f1b,zbv,...] [--repeats N] [--lean] [--fit X] [--walk]

``--lean`` also runs each zero-bubble schedule's lean order
(``build(lean=True)``: no microbatch waits for its W beyond the in-flight
count), as "zbv lean". ``--fit X`` also runs, for each schedule but 1F1B,
what ``fastpipe.plan`` chooses for it under a memory limit of X times
1F1B's walk (activations only; order, lean or not, and split), as "zbv
fit", where anything fits. The step's median time is printed beside (the
sampling adds the same small cost to every action). ``--walk`` runs nothing
and prints the planner's candidates for the schedules instead (``Plan.explain``:
each order's simulated step and walked peak per rank, lean and lean/bytes
among them).

Linux with glibc 2.33 or later only (``mallinfo2``).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench._runner import spawn, workload_parser
from bench._workloads import selected, workload
from bench.pipelining import SCHEDULES, TWO_STAGES, balance, describe_orders, order

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
           "fordblks", "keepcost")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _heap_reader():
    """A function returning the bytes malloc has handed out, or None without glibc's mallinfo2."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2

    def in_use() -> int:
        info = fn()
        return info.uordblks + info.hblkhd

    return in_use


def _sampling(in_use, peak: list[int]):
    """Makes every RankExecutor made from now on sample the heap after each action."""
    from fastpipe.runtime.executor import RankExecutor

    made = RankExecutor.__init__

    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)

        def sampled(verb):
            def run(executor, action):
                out = verb(executor, action)
                peak[0] = max(peak[0], in_use())
                return out
            return run

        self._verbs = {kind: sampled(verb) for kind, verb in self._verbs.items()}

    RankExecutor.__init__ = init


def _measure(w, schedule: str, bal, runs, warmup: int, steps: int, in_use, peak: list[int]):
    from fastpipe import Pipe

    x, y = w.data()
    spr = 2 if schedule in TWO_STAGES else None
    pipe = Pipe(w.build(), chunks=w.chunks, schedule=runs, balance=bal, stages_per_rank=spr)
    try:
        for _ in range(warmup):
            pipe.step(x, y, w.loss_fn)
        growth, times = [], []
        for _ in range(steps):
            base = peak[0] = in_use()
            start = time.perf_counter()
            pipe.step(x, y, w.loss_fn)
            times.append(time.perf_counter() - start)
            growth.append(peak[0] - base)
        booked = pipe.memory_stats()[pipe.rank]["activations_peak"]
    finally:
        pipe.close()
    return min(growth), booked, statistics.median(times)


def _rank_main(rank, world, init, queue, name, balances, orders, warmup, steps):
    """``balances`` and ``orders`` by label ("zbv", "zbv lean", "zbv fit")."""
    torch.set_num_threads(1)
    in_use, peak = _heap_reader(), [0]
    _sampling(in_use, peak)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    w = workload(name)
    try:
        results = {label: _measure(w, label.split()[0], balances[label], runs, warmup,
                                   steps, in_use, peak)
                   for label, runs in orders.items()}
    finally:
        dist.destroy_process_group()
    queue.put((rank, results))


def _fitted(w, schedules: list[str], factor: float, ranks: int) -> dict:
    """label -> (order, balance): what ``fastpipe.plan`` picks for each
    schedule under ``factor`` times 1F1B's walk, where it finds a fit."""
    from bench._workloads import _profile
    from fastpipe import plan

    x, _ = w.data()
    model, prof = w.build(), _profile(w.name)
    args = dict(chunks=[w.chunks], checkpoints=["never"], param_scale=0.0, prof=prof)
    limit = int(factor * max(plan(model, x, ranks, schedules=["1f1b"], **args).best.memory))
    out = {}
    for s in schedules:
        if s == "1f1b":
            continue
        try:
            c = plan(model, x, ranks, memory_limit=limit, schedules=[s], **args).best
        except ValueError:  # nothing fits: no row
            continue
        out[f"{s} fit"] = (c.order if c.order is not None else s, list(c.balance))
    return out


def walk(w, schedules: list[str], ranks: int = 2) -> None:
    """Runs nothing: ``fastpipe.plan``'s candidates for ``schedules`` over a
    profile of the workload with its loss (no checkpointing, parameters left
    out), each with its simulated step and walked peak per rank
    (``Plan.explain``)."""
    from fastpipe import plan

    from bench._workloads import _profile

    x, _ = w.data()
    print(f"\n{w.name}: {w.describe()}, {ranks} ranks; the planner's walk, activations only")
    plan(w.build(), x, ranks, schedules=schedules, chunks=[w.chunks], checkpoints=["never"],
         param_scale=0.0, prof=_profile(w.name)).explain()


def run(w, schedules: list[str], warmup: int, steps: int, ranks: int = 2, by_cost: bool = True,
        lean: bool = False, fit: float | None = None) -> None:
    from fastpipe.schedules import orders_by_cost

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    balances = {s: balance(w, s, ranks) for s in schedules}
    orders = {}
    for s in schedules:
        orders[s] = order(w, s, balances[s], ranks, by_cost)
        if lean and orders_by_cost(s):
            orders[f"{s} lean"] = order(w, s, balances[s], ranks, by_cost, lean=True)
            balances[f"{s} lean"] = balances[s]
    if fit is not None:
        for label, (runs, bal) in _fitted(w, schedules, fit, ranks).items():
            orders[label], balances[label] = runs, bal
    per_rank = spawn(ranks, _rank_main, w.name, balances, orders, warmup, steps)
    print(f"\n{w.name}: {w.describe()}, {ranks} gloo ranks x 1 thread; least heap growth of "
          f"{steps} steps and the booked activation peak, MB; median step, ms")
    print(describe_orders({s: o for s, o in orders.items() if " " not in s}))
    if fit is not None:
        fitted = [f"{label} {balances[label]}" for label in orders if label.endswith(" fit")]
        print(f"  under {fit:g}x 1F1B's walk, fastpipe.plan picks: {', '.join(fitted) or 'nothing fits'}")
    print(f"  {'schedule':<18}{'rank':>5}{'heap':>9}{'booked':>9}{'booked/heap':>13}{'step':>9}")
    for label in orders:
        for rank in range(ranks):
            heap, booked, step = per_rank[rank][label]
            ratio = f"{booked / heap:>13.2f}" if heap > 0 else f"{'-':>13}"
            print(f"  {label if rank == 0 else '':<18}{rank:>5}{heap / 2**20:>9.2f}"
                  f"{booked / 2**20:>9.2f}{ratio}{step * 1e3:>9.1f}")


def main(argv=None) -> int:
    parser = workload_parser("python -m bench memory", __doc__, SCHEDULES)
    parser.add_argument("--lean", action="store_true",
                        help="also run each zero-bubble schedule's lean order (build(lean=True))")
    parser.add_argument("--fit", type=float, default=None, metavar="X",
                        help="also run what fastpipe.plan picks for each schedule under X times "
                             "1F1B's memory walk")
    parser.add_argument("--walk", action="store_true",
                        help="run nothing: print fastpipe.plan's candidates for the schedules "
                             "(simulated step, walked peak per rank: default, lean, lean/bytes)")
    args = parser.parse_args(argv)
    if args.walk:
        for w in selected(args):
            walk(w, args.schedules.split(","))
        return 0
    if _heap_reader() is None:
        raise SystemExit("bench memory needs glibc's mallinfo2 (glibc 2.33 or later)")
    for w in selected(args):
        run(w, args.schedules.split(","), args.warmup, args.repeats, by_cost=not args.built_in_order,
            lean=args.lean, fit=args.fit)
    return 0
