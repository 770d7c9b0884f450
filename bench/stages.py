"""What a stage boundary costs: the same layers as one stage and as two, on one rank.

The interleaved and V schedules give each rank two stages, so every
microbatch crosses a rank's layers in two F, two B (or I and W) actions
instead of one. This measures what that costs apart from the pipeline: one
process (a world of one gloo rank, one intra-op thread), the workload's
layers as one stage and split in half as two, for each pair of schedules
that run the same work with one and two stages a rank (1f1b |
interleaved-1f1b, zb-h1 | zbv). The Pipes of a pair are stepped in turns
(``Pipe.step_with_timeline``), so drift falls on both; the report gives each
Pipe's median step and, per action kind, the median action time summed over
the stages (a microbatch's F through all its layers, and so on), then what
the second stage adds per microbatch. There are no messages here: between
ranks each crossing adds a send and a receive too (``bench timeline``).

    python -m bench stages [--model gpt] [--workload compute|overhead] [--blocks N] [--repeats N]
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from bench._runner import spawn, workload_parser
from bench._workloads import selected, workload
from fastpipe import Pipe

PAIRS = [("1f1b", "interleaved-1f1b"), ("zb-h1", "zbv")]


def _rank_main(rank, world, init, queue, name, repeats, warmup):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    w = workload(name)
    x, y = w.data()
    layers = len(w.build())
    halves = [layers // 2, layers - layers // 2]
    runs = [(s, bal) for pair in PAIRS for s, bal in zip(pair, ([layers], halves))]
    pipes = [Pipe(w.build(), chunks=w.chunks, schedule=s, balance=bal) for s, bal in runs]
    steps: list[list[float]] = [[] for _ in pipes]
    actions: list[dict] = [{} for _ in pipes]
    try:
        for pipe in pipes:
            for _ in range(warmup):
                pipe.step(x, y, w.loss_fn)
        for _ in range(repeats):
            for i, pipe in enumerate(pipes):
                _, sim = pipe.step_with_timeline(x, y, w.loss_fn)
                steps[i].append(sim.makespan)
                for r in sim.timeline:
                    if r.track == "compute":
                        actions[i].setdefault((r.action.kind.value, r.action.stage), []).append(
                            r.end - r.start)
    finally:
        for pipe in pipes:
            pipe.close()
        dist.destroy_process_group()
    out = []
    for (s, bal), times, acts in zip(runs, steps, actions):
        kinds: dict[str, float] = {}
        for (kind, _), durations in acts.items():  # milliseconds
            kinds[kind] = kinds.get(kind, 0.0) + statistics.median(durations)
        out.append((s, bal, statistics.median(times), kinds))
    queue.put((rank, out))


def main(argv=None) -> int:
    parser = workload_parser("python -m bench stages", __doc__, [])
    args = parser.parse_args(argv)
    if args.balance:
        parser.error("bench stages splits the layers in halves itself: --balance does not apply")
    for w in selected(args):
        runs = spawn(1, _rank_main, w.name, args.repeats, args.warmup)[0]
        print(f"\n{w.name}: {w.describe()}, one gloo rank x 1 thread; medians of {args.repeats} "
              "steps, ms (an action kind: summed over the stages, per microbatch)")
        print(f"  {'schedule':<18}{'stages':>16}{'step':>9}{'F':>8}{'B':>8}{'I':>8}{'W':>8}")
        for one, two in zip(runs[::2], runs[1::2]):
            for s, bal, step, kinds in (one, two):
                cells = "".join(f"{kinds[k]:>8.3f}" if k in kinds else f"{'':>8}" for k in "FBIW")
                print(f"  {s:<18}{str(bal):>16}{step:>9.2f}{cells}")
            extra = "".join(f"{(two[3][k] - one[3][k]) * 1e3:>8.0f}" if k in one[3] else f"{'':>8}"
                            for k in "FBIW")
            print(f"  {'second stage adds, us a microbatch':<34}"
                  f"{(two[2] - one[2]) / w.chunks * 1e3:>9.0f}{extra}")
    return 0
