"""Local mode against torchgpipe: one process, two "cpu" devices, one intra-op thread.

Both libraries pipeline the same ``nn.Sequential`` over the same microbatches;
efficiency = (sequential microbatched fwd+bwd ÷ 2) / step time, and the
ratio column is torchgpipe's step time over fastpipe's (its throughput
ratio). torchgpipe (``pip install torchgpipe``) runs GPipe only; fastpipe
runs every schedule. The sequential baseline, torchgpipe and every schedule
are timed in turns (three steps each per round), so machine drift hits all
of them alike. So is a reference without a pipeline: the model's two halves
run on two threads with nothing between them, both forward and backward at
once. It shows what one GIL lets two threads overlap; it is not a bound (a
pipeline can do better by running one rank's forward, which needs the GIL,
beside the other's backward, which does not: 1F1B does).

fastpipe's B defers weight gradients by default (``Pipe(fused_wgrad=True)``:
each Linear's accumulated by one GEMM into ``.grad``), cheaper work than the
sequential baseline's; efficiencies stay against that baseline, so they
compare throughput. Rows marked ``autograd-B`` (``--autograd-b``) run with
``fused_wgrad=False``, B as autograd's backward. fastpipe's zero-bubble
schedules are given by name, so each Pipe reorders itself for its second
step's measured action times where that is faster (``bench.pipelining.order``;
``--built-in-order`` runs the built-in lists).

One intra-op thread means one in every thread: ``torch.set_num_threads(1)``
reaches only the thread that calls it, and threads that torch did not start
(torchgpipe's workers, this file's two-thread reference) otherwise keep
OpenMP's default of one per core. The benchmark therefore runs itself with
``OMP_NUM_THREADS=1`` (re-executing when it is not set), so the peer gets the
same single thread per worker as fastpipe's ranks, which apply the caller's
count on their lanes themselves.

    python -m bench local [--model gpt|mlp|both] [--workload compute|overhead|both]
                          [--blocks N] [--repeats N] [--autograd-b]
"""

from __future__ import annotations

import functools
import os
import sys

import torch
from torch import nn

from bench._runner import round_robin_medians, workload_parser
from bench._workloads import Workload, selected
from bench.pipelining import TWO_STAGES, balance, describe_orders, order, reordered

SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev"]


def _torchgpipe_step(w: Workload):
    try:
        from torchgpipe import GPipe
    except ImportError:
        return None
    gpipe = GPipe(w.build(), balance=balance(w, "gpipe"), devices=["cpu", "cpu"], chunks=w.chunks,
                  checkpoint="never")
    loss_fn = w.loss_fn

    def step(x, y):
        loss_fn(gpipe(x), y).backward()

    return step


def _two_threads_step(w: Workload):
    """The two halves of the model, fwd+bwd over every microbatch, on two
    threads with nothing between them: no pipeline dependencies, no
    transfers: what the GIL and the two cores let two threads of Python
    stages overlap when both run the same kind of work at once."""
    import threading

    model = w.build()
    half = balance(w, "1f1b")[0]
    parts = [model[:half], model[half:]]
    x, _ = w.data()
    with torch.no_grad():
        inputs = [x.tensor_split(w.chunks), model[:half](x).tensor_split(w.chunks)]

    def work(part, xs):
        torch.set_num_threads(1)
        for x in xs:
            # The graph freed after the backward, not inside it, as fastpipe's
            # local mode does (fastpipe.runtime._backward): freeing inside
            # takes the GIL once per saved tensor.
            loss = part(x).float().square().mean()
            loss.backward(retain_graph=True)
            del loss

    def step():
        threads = [threading.Thread(target=work, args=(p, xs)) for p, xs in zip(parts, inputs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return step


PLAIN = " autograd-B"


def run(w: Workload, repeats: int, warmup: int, schedules: list[str], autograd_b: bool = False,
        by_cost: bool = True) -> None:
    from fastpipe import Pipe
    from fastpipe.schedules import orders_by_cost

    torch.set_num_threads(1)
    x, y = w.data()
    runners = {"sequential": w.sequential_step(), "two threads": _two_threads_step(w)}
    theirs_step = _torchgpipe_step(w)
    if theirs_step is not None:
        runners["torchgpipe"] = functools.partial(theirs_step, x, y)
    pipes = []
    variants = [True, False] if autograd_b else [True]
    orders = {}
    for schedule in schedules:
        spr = 2 if schedule in TWO_STAGES else None
        bal = balance(w, schedule)
        orders[schedule] = order(w, schedule, bal, by_cost=by_cost)
        for f in variants:
            pipes.append(Pipe(w.build(), chunks=w.chunks, balance=bal, schedule=orders[schedule],
                              devices=["cpu", "cpu"], stages_per_rank=spr, fused_wgrad=f))
            name = schedule + ("" if f else PLAIN)
            runners[name] = functools.partial(pipes[-1].step, x, y, w.loss_fn)
    # In turns (a few steps of each, round after round), so machine drift
    # falls on the baseline, the peer and every schedule alike.
    times = round_robin_medians(runners, warmup, max(1, repeats // 3), lambda: None, per_round=3)
    moved = [s for s, pipe in zip(schedules, pipes[::len(variants)])
             if orders_by_cost(s) and reordered(pipe)]
    for pipe in pipes:
        pipe.close()
    seq, theirs = times.pop("sequential"), times.pop("torchgpipe", None)
    both = times.pop("two threads")
    rows = times
    ideal = seq / 2
    print(f"\n{w.name}, local mode: {w.describe()}, 2 cpu devices x 1 thread; "
          f"sequential fwd+bwd {seq * 1e3:.1f} ms")
    print(f"  two threads, no pipeline (the halves at once) {both * 1e3:.1f} ms, "
          f"efficiency {ideal / both:.2f}")
    if theirs is not None:
        print(f"  torchgpipe (GPipe)  {theirs * 1e3:8.1f} ms  efficiency {ideal / theirs:.2f}")
    else:
        print("  torchgpipe not installed: pip install torchgpipe==0.0.7 for the peer column")
    print(describe_orders(orders, moved))
    print(f"  {'fastpipe schedule':<21}{'ms':>9}{'efficiency':>12}{'torchgpipe/fastpipe':>21}")
    for schedule, ours in rows.items():
        ratio = f"{theirs / ours:>21.2f}" if theirs is not None else ""
        print(f"  {schedule:<21}{ours * 1e3:>9.1f}{ideal / ours:>12.2f}{ratio}")


def _single_threaded(argv: list[str]) -> None:
    """Re-executes this benchmark with OMP_NUM_THREADS=1 unless it has it."""
    if os.environ.get("OMP_NUM_THREADS") != "1":
        os.environ["OMP_NUM_THREADS"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "bench", "local", *argv])


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[2:] if sys.argv[1:2] == ["local"] else sys.argv[1:]
    _single_threaded(argv)
    parser = workload_parser("python -m bench local", __doc__, SCHEDULES)
    parser.add_argument("--autograd-b", action="store_true",
                        help="also fastpipe rows with Pipe(fused_wgrad=False): B as autograd's backward")
    args = parser.parse_args(argv)
    for w in selected(args):
        run(w, args.repeats, args.warmup, args.schedules.split(","), args.autograd_b,
            by_cost=not args.built_in_order)
    return 0
