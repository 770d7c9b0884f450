"""Local mode against torchgpipe: one process, two "cpu" devices, one intra-op thread.

Both libraries pipeline the same ``nn.Sequential`` over the same microbatches;
efficiency = (sequential microbatched fwd+bwd ÷ 2) / step time, and the
ratio column is torchgpipe's step time over fastpipe's (its throughput
ratio). torchgpipe (``pip install torchgpipe``) runs GPipe only; fastpipe
runs every schedule. The sequential baseline is timed between the pipelined
runs and its median used, so machine drift hits both sides alike.

    python -m bench local [--workload compute|overhead|both] [--repeats N]
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from bench._runner import median_time, workload_parser, workloads
from bench.pipelining import TWO_STAGES, WORKLOADS, make_model, sequential_time

SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev"]


def _torchgpipe_step(width, blocks, chunks):
    try:
        from torchgpipe import GPipe
    except ImportError:
        return None
    model = make_model(width, blocks)
    half = len(model) // 2
    gpipe = GPipe(model, balance=[half, len(model) - half], devices=["cpu", "cpu"], chunks=chunks,
                  checkpoint="never")

    def step(x, y):
        nn.functional.mse_loss(gpipe(x), y).backward()

    return step


def run(workload: str, repeats: int, warmup: int, schedules: list[str]) -> None:
    from fastpipe import Pipe

    torch.set_num_threads(1)
    width, blocks, batch, chunks = WORKLOADS[workload]
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    baselines = [sequential_time(width, blocks, batch, chunks, warmup, repeats)]
    theirs_step = _torchgpipe_step(width, blocks, chunks)
    theirs = None
    if theirs_step is not None:
        theirs = median_time(lambda: theirs_step(x, y), warmup, repeats, lambda: None)
    rows = {}
    for schedule in schedules:
        spr = 2 if schedule in TWO_STAGES else None
        pipe = Pipe(make_model(width, blocks), chunks=chunks, schedule=schedule,
                    devices=["cpu", "cpu"], stages_per_rank=spr)
        rows[schedule] = median_time(lambda: pipe.step(x, y, nn.functional.mse_loss), warmup, repeats,
                                     lambda: None)
        pipe.close()
        baselines.append(sequential_time(width, blocks, batch, chunks, warmup, repeats))
    seq = statistics.median(baselines)
    ideal = seq / 2
    print(f"\n{workload}-bound, local mode: {blocks} MLP blocks d={width}, batch {batch}, {chunks} "
          f"microbatches, 2 cpu devices x 1 thread; sequential fwd+bwd {seq * 1e3:.1f} ms (median of "
          f"{len(baselines)})")
    if theirs is not None:
        print(f"  torchgpipe (GPipe)  {theirs * 1e3:8.1f} ms  efficiency {ideal / theirs:.2f}")
    else:
        print("  torchgpipe not installed: pip install torchgpipe==0.0.7 for the peer column")
    print(f"  {'fastpipe schedule':<18}{'ms':>9}{'efficiency':>12}{'torchgpipe/fastpipe':>21}")
    for schedule, ours in rows.items():
        ratio = f"{theirs / ours:>21.2f}" if theirs is not None else ""
        print(f"  {schedule:<18}{ours * 1e3:>9.1f}{ideal / ours:>12.2f}{ratio}")


def main(argv=None) -> int:
    args = workload_parser("python -m bench local", __doc__, SCHEDULES).parse_args(argv)
    for w in workloads(args):
        run(w, args.repeats, args.warmup, args.schedules.split(","))
    return 0
