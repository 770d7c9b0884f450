"""Train a small GPT with a pipeline in one process.

Each pipeline rank runs as a thread on its own device: two GPUs if there
are, else two CPU ranks (a real two-rank pipeline on one machine).

    python examples/train_local.py                       # 1F1B, 100 steps
    python examples/train_local.py --schedule zbv --steps 50
    python examples/train_local.py --devices cuda:0 cuda:1 --bf16
"""

from __future__ import annotations

import argparse
import time

import torch

from fastpipe import Pipe
from tiny_gpt import batch, gpt, loss_fn

V_SHAPED = {"zbv": 2, "dualpipev": 2, "interleaved-1f1b": 2, "looped-bfs": 2}  # stages per rank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="1f1b", help="see fastpipe.schedules.names()")
    p.add_argument("--devices", nargs="+", help="one per pipeline rank (default: 2 GPUs or 2 CPUs)")
    p.add_argument("--chunks", type=int, default=8, help="microbatches per step")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPUs)")
    args = p.parse_args()

    devices = args.devices or (["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"])
    model = gpt(width=args.width, blocks=args.blocks)
    pipe = Pipe(model, chunks=args.chunks, schedule=args.schedule, devices=devices,
                stages_per_rank=V_SHAPED.get(args.schedule))
    print(pipe)  # schedule, chunks, layers per stage
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = batch(step, args.batch)
        optimizer.zero_grad()
        with torch.autocast(torch.device(devices[0]).type, torch.bfloat16, enabled=args.bf16):
            loss = pipe.step(x, y, loss_fn)  # forward and backward of every microbatch
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - start:.1f} s")
    pipe.close()


if __name__ == "__main__":
    main()
