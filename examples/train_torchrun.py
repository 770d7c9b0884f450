"""Train a small GPT with one pipeline rank per process, under torchrun.

    torchrun --nproc-per-node 2 examples/train_torchrun.py
    torchrun --nproc-per-node 4 examples/train_torchrun.py --schedule zbv

CPUs: gloo (ranks on one host exchange messages through shared memory).
GPUs: NCCL, one GPU per process. Every process builds the same model (same
seed) and keeps only its own stages' parameters for its optimizer; the
first stage's rank reads the inputs, the last stage's rank the targets.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from fastpipe import Pipe
from tiny_gpt import batch, gpt, loss_fn

V_SHAPED = {"zbv": 2, "dualpipev": 2, "interleaved-1f1b": 2, "looped-bfs": 2}  # stages per rank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="1f1b", help="see fastpipe.schedules.names()")
    p.add_argument("--chunks", type=int, default=8, help="microbatches per step")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--blocks", type=int, default=6)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = gpt(width=args.width, blocks=args.blocks).to(device)
    pipe = Pipe(model, chunks=args.chunks, schedule=args.schedule,
                stages_per_rank=V_SHAPED.get(args.schedule))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)  # this rank's stages only
    first, last = pipe.schedule.stage_to_rank[0], pipe.schedule.stage_to_rank[-1]
    for step in range(1, args.steps + 1):
        x, y = batch(step, args.batch)
        x = x.to(device) if pipe.rank == first else None
        y = y.to(device) if pipe.rank == last else None
        optimizer.zero_grad()
        loss = pipe.step(x, y, loss_fn)  # the same mean loss on every rank
        pipe.clip_grad_norm_(1.0)  # the norm over every rank's gradients
        optimizer.step()
        if dist.get_rank() == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
