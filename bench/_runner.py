"""Shared benchmark runner: spawn gloo ranks on 127.0.0.1 and time steps by median."""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator

from fastpipe._spawn import spawn  # noqa: F401  (re-exported for the benchmarks)


def median_time(fn: Callable[[], object], warmup: int, repeats: int, sync: Callable[[], None]) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs, after ``warmup`` runs.

    ``sync`` (a barrier across ranks) runs before each timed call so every rank
    starts the step together and the slowest rank decides the time.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def round_robin_medians(fns: dict, warmup: int, rounds: int, sync: Callable[[], None],
                        per_round: int = 1, settle: int = 1) -> dict:
    """Median time of each of ``fns`` (name -> callable), measured in turns.

    Every round times each callable ``per_round`` times before going on to
    the next, so a slow spell of the machine falls on all of them rather than
    on whichever happened to run then; the figure is the median over rounds
    of each round's median. ``warmup`` untimed runs of each come first, and
    ``settle`` untimed runs open every turn: the first step after another
    workload runs on caches and pages that workload left (a local 1F1B step
    right after torchgpipe's took 27-31 ms against 20 ms once settled, and
    which row came after torchgpipe decided whose median it spoiled), which
    a training loop running one pipeline step after step never sees. What
    a turn leaves the next lasts longer than that on some pairs (a Pipe
    right after another library's runner ran a few per cent slower than the
    same list elsewhere in the round), so each round takes the callables in
    an order of its own: a shuffle seeded by the round, the same on every
    rank.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[:]
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(median_time(fns[name], settle, per_round, sync))
    return {name: statistics.median(t) for name, t in times.items()}


def workload_parser(prog: str, doc: str | None, schedules: list[str]):
    """The command line the pipelining benchmarks share: workload, repeats, warm-up, schedules."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--model", choices=["gpt", "mlp", "both", "hf-gpt2", "hf-llama"], default="both",
                        help="the GPT (first) and/or the MLP stack, or a Hugging Face model "
                             "(bench._workloads)")
    parser.add_argument("--workload", choices=["compute", "overhead", "both"], default="both")
    parser.add_argument("--blocks", type=int, default=None,
                        help="the transformers' block count, in place of the workload's own "
                             "(a deeper or shallower model of the same width)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--schedules", default=",".join(schedules))
    parser.add_argument("--balance", action="append", type=_split, metavar="SCHEDULE=N,N,...",
                        help="layers per stage for SCHEDULE, in place of the split from the "
                             "profile (both libraries run it; may be given once per schedule)")
    parser.add_argument("--built-in-order", action="store_true",
                        help="run fastpipe's zero-bubble schedules in their built-in order (a "
                             "Schedule), not the order each Pipe picks for its measured step")
    return parser


def _split(text: str) -> tuple[str, tuple[int, ...]]:
    """``zbv=3,1,2,2`` -> ("zbv", (3, 1, 2, 2))."""
    import argparse

    name, _, counts = text.partition("=")
    try:
        split = tuple(int(n) for n in counts.split(","))
    except ValueError:
        split = ()
    if not name or not split or min(split) < 1:
        raise argparse.ArgumentTypeError(f"expected SCHEDULE=N,N,... (e.g. zbv=3,1,2,2), got {text!r}")
    return name, split


@contextlib.contextmanager
def switched(**switches: str) -> Iterator[None]:
    """``FASTPIPE_*`` switches set (``chain="0"`` is ``FASTPIPE_CHAIN=0``) for
    the Pipes built inside: a Pipe reads them once, when it is built."""
    names = {f"FASTPIPE_{k.upper()}": v for k, v in switches.items()}
    before = {k: os.environ.get(k) for k in names}
    os.environ.update(names)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
