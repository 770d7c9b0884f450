"""fastpipe vs torch.distributed.pipelining: same model, microbatches, schedules.

Two gloo ranks on 127.0.0.1, one intra-op thread each. Both libraries run
in the same processes, and every row of the report, the baselines included,
is timed in turns: a few steps of each, round after round, so a slow spell
of the machine falls on all of them, and efficiencies and ratios between
schedules compare the same minutes. The report gives each one's median step
time, their ratio, and efficiency = (sequential fwd+bwd of all microbatches
÷ ranks) / step time. fastpipe runs three times: with its default on CPUs
(transfers inline on the compute thread, through shared-memory rings since
both ranks share this host: ``Pipe(shm=None)``), with the same inline
transfers through gloo (``shm=False``), and with its communication lanes
over gloo (``overlap=True``); "gloo/default" and "lanes/default" are what
those change. The sequential baseline runs on rank 0 while the other rank
waits. The ceiling is each rank running its share of the layers alone, both
at once, with no messages: the most any pipeline on these ranks can reach;
"of ceiling" is its step time over fastpipe's.

fastpipe's B defers weight gradients by default (``Pipe(fused_wgrad=True)``:
each Linear's accumulated by one GEMM into ``.grad``), which makes the work
itself cheaper than the sequential baseline's; efficiencies stay against
that baseline, so they compare throughput. With ``--autograd-b`` fastpipe
also runs with ``fused_wgrad=False`` (B as autograd's backward): the
"autograd-B" columns.

The workloads (``bench._workloads``): a GPT first, then the MLP stack, each
compute-bound and overhead-bound; both libraries get the same layers per
stage: the measured layer times split as ``Pipe(balance="auto")`` splits
them (``Workload.balance``; the report prints it). fastpipe runs its
zero-bubble schedules by name, as a user would, so each Pipe reorders itself
for the action times its second step measured where that simulates faster
(``order``; the report says which did, and times the built-in order beside
it; ``--built-in-order`` runs only the built-in lists); torch runs its own.

    python -m bench pipelining [--model gpt|mlp|both] [--workload compute|overhead|both]
                               [--blocks N] [--repeats N] [--autograd-b]
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
import torch.distributed as dist
from torch import nn

from bench._runner import round_robin_medians, spawn, workload_parser
from bench._workloads import Workload, selected, workload

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2", "zbv", "dualpipev"]
TWO_STAGES = {"interleaved-1f1b", "looped-bfs", "zbv", "dualpipev"}
V_SHAPED = {"zbv", "dualpipev"}


def balance(w: Workload, schedule: str, ranks: int = 2) -> list[int]:
    """The split both libraries run for ``schedule`` (``Workload.balance``)."""
    from fastpipe.schedules import build

    spr = 2 if schedule in TWO_STAGES else 1
    return w.balance(build(schedule, ranks, w.chunks, stages_per_rank=spr))


def order(w: Workload, schedule: str, bal: list[int], ranks: int = 2, by_cost: bool = True,
          lean: bool = False):
    """What fastpipe runs for ``schedule`` over ``bal``: its name, as a user
    writes it (a zero-bubble Pipe then reorders itself for its second step's
    measured action times, ``Pipe(schedule=)``); with ``by_cost`` False the
    built-in list as a ``Schedule``, which runs as given. ``lean``: the
    schedule's lean order (``build(lean=True)``), ordered for the workload's
    profiled stage costs where that simulates faster, as ``fastpipe.plan``
    does (``fastpipe._plan.ordered``)."""
    from bench._workloads import _profile
    from fastpipe._plan import _cost_fn, _stage_sums, ordered
    from fastpipe.schedules import build, orders_by_cost

    spr = 2 if schedule in TWO_STAGES else 1
    if not lean:
        return schedule if by_cost or not orders_by_cost(schedule) else \
            build(schedule, ranks, w.chunks, stages_per_rank=spr)
    built = build(schedule, ranks, w.chunks, stages_per_rank=spr, lean=True)
    if not by_cost:
        return built
    cost = _cost_fn(_stage_sums(_profile(w.name), bal), "never", w.chunks, built, 0.0)
    return ordered(built, cost, lean=True)[0]


def reordered(pipe) -> bool:
    """Whether ``pipe`` reordered its zero-bubble schedule for a measured step."""
    from fastpipe.schedules import build

    s = pipe.schedule
    return s.actions != build(s.name, s.ranks, s.microbatches, s.stages // s.ranks).actions


def describe_orders(orders: dict, moved: list[str] | None = None) -> str:
    """How fastpipe orders its zero-bubble schedules here, for a report
    (``moved``: the ones whose Pipe reordered itself, where known)."""
    from fastpipe.schedules import orders_by_cost

    named = [s for s, o in orders.items() if isinstance(o, str) and orders_by_cost(o)]
    if not named:
        return "  zero-bubble orders: the built-in lists"
    line = ("  zero-bubble orders: each Pipe's own, for its second step's measured action times "
            f"({', '.join(named)})")
    if moved is not None:
        line += "; reordered: " + (", ".join(moved) if moved else "none")
    return line


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


def _alone_step(w: Workload, rank, bal):
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

    return step


def _rank_main(rank, world, init, queue, name, balances, orders, ceiling, warmup, repeats,
               autograd_b=False):
    """Builds every runner on this rank (the sequential baselines on rank 0
    only, the ceiling, every schedule's fastpipe variants and torch's peer)
    and times them all in one round robin: every figure of the report, the
    efficiencies included, then comes from the same minutes of the machine."""
    from fastpipe import Pipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    w = workload(name)
    chunks, loss_fn = w.chunks, w.loss_fn
    x, y = w.data()
    from fastpipe.schedules import orders_by_cost

    pipes, runners, unavailable, ours = [], {}, {}, {}
    try:
        # The baselines run on rank 0 alone; the other rank waits at the
        # barrier around each timed call.
        runners["sequential"] = w.sequential_step() if rank == 0 else (lambda: None)
        runners["alone"] = _alone_step(w, rank, ceiling)
        for schedule, bal in balances.items():
            spr = 2 if schedule in TWO_STAGES else None
            variants = {"ours": dict(overlap=False, shm=None), "gloo": dict(overlap=False, shm=False),
                        "lanes": dict(overlap=True, shm=None)}
            if autograd_b:
                variants["autograd-B"] = dict(fused_wgrad=False)
            for variant, kwargs in variants.items():
                pipes.append(Pipe(w.build(), chunks=chunks, schedule=orders[schedule], balance=bal,
                                  stages_per_rank=spr, **kwargs))
                runners[schedule, variant] = functools.partial(pipes[-1].step, x, y, loss_fn)
            ours[schedule] = pipes[-len(variants)]
            if isinstance(orders[schedule], str) and orders_by_cost(schedule):
                # The built-in order beside the one the Pipe picks for itself.
                pipes.append(Pipe(w.build(), chunks=chunks, schedule=order(w, schedule, bal, world, False),
                                  balance=bal, stages_per_rank=spr, overlap=False, shm=None))
                runners[schedule, "built-in"] = functools.partial(pipes[-1].step, x, y, loss_fn)
            try:
                runners[schedule, "theirs"] = functools.partial(
                    _torch_runner(schedule, w.build(), rank, world, chunks, loss_fn, bal), x, y)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
                unavailable[schedule, "theirs"] = f"n/a ({type(exc).__name__})"
        # In turns (three steps each per round), so a slow spell of the
        # machine falls on every row and on the baselines alike.
        times = round_robin_medians(runners, warmup, max(1, repeats // 3), dist.barrier, per_round=3)
        moved = [s for s, pipe in ours.items() if orders_by_cost(s) and reordered(pipe)]
    finally:
        for pipe in pipes:
            pipe.close()
        dist.destroy_process_group()
    queue.put((rank, {**times, **unavailable, "reordered": moved}))


def run(w: Workload, repeats: int, warmup: int, schedules: list[str], ranks: int = 2,
        autograd_b: bool = False, by_cost: bool = True) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    balances = {s: balance(w, s, ranks) for s in schedules}
    orders = {s: order(w, s, balances[s], ranks, by_cost) for s in schedules}
    ceiling = balance(w, "1f1b", ranks)  # one stage per rank
    times = spawn(ranks, _rank_main, w.name, balances, orders, ceiling, warmup, repeats, autograd_b)[0]
    seq, alone = times["sequential"], times["alone"]
    ideal = seq / ranks
    print(f"\n{w.name}: {w.describe()}, {ranks} gloo ranks x 1 thread; "
          f"sequential fwd+bwd {seq * 1e3:.1f} ms")
    print(f"  each rank its layers alone, no pipeline (the two-rank ceiling) {alone * 1e3:.1f} ms, "
          f"efficiency {ideal / alone:.2f}")
    print("  layers per stage (both libraries): " + ", ".join(
        f"{s} {balances[s]}" for s in schedules))
    print(describe_orders(orders, times["reordered"]))
    plain_head = f"{'autograd-B ms':>15}{'torch/autograd-B':>18}{'eff autograd-B':>16}" if autograd_b else ""
    print(f"  {'schedule':<18}{'fastpipe ms':>12}{'gloo ms':>9}{'lanes ms':>10}{'torch ms':>10}"
          f"{'torch/fastpipe':>16}{'gloo/default':>14}{'lanes/default':>15}{'eff fastpipe':>14}"
          f"{'eff torch':>11}{'of ceiling':>12}{plain_head}")
    for schedule in schedules:
        ours, gloo, lanes = (times[schedule, v] for v in ("ours", "gloo", "lanes"))
        theirs, plain = times[schedule, "theirs"], times.get((schedule, "autograd-B"))
        head = f"  {schedule:<18}{ours * 1e3:>12.1f}{gloo * 1e3:>9.1f}{lanes * 1e3:>10.1f}"
        tail = ""
        if plain is not None:
            vs = f"{theirs / plain:>18.2f}" if not isinstance(theirs, str) else f"{'':>18}"
            tail = f"{plain * 1e3:>15.1f}{vs}{ideal / plain:>16.2f}"
        if isinstance(theirs, str):
            peer = f"{theirs:>10}{'':>16}"
            peer_eff = f"{'':>11}"
        else:
            peer = f"{theirs * 1e3:>10.1f}{theirs / ours:>16.2f}"
            peer_eff = f"{ideal / theirs:>11.2f}"
        print(f"{head}{peer}{gloo / ours:>14.2f}{lanes / ours:>15.2f}{ideal / ours:>14.2f}"
              f"{peer_eff}{alone / ours:>12.2f}{tail}")
    builtin = [(s, times[s, "built-in"], times[s, "ours"]) for s in schedules if (s, "built-in") in times]
    if builtin:
        print("  the same schedules in their built-in order: " + ", ".join(
            f"{s} {b * 1e3:.1f} ms (built-in/fastpipe {b / o:.2f})" for s, b, o in builtin))


def main(argv=None) -> int:
    parser = workload_parser("python -m bench pipelining", __doc__, SCHEDULES)
    parser.add_argument("--autograd-b", action="store_true",
                        help="also run fastpipe with Pipe(fused_wgrad=False): B as autograd's backward")
    args = parser.parse_args(argv)
    for w in selected(args):
        run(w, args.repeats, args.warmup, args.schedules.split(","), autograd_b=args.autograd_b,
            by_cost=not args.built_in_order)
    return 0
