"""Let fastpipe choose schedule, microbatches, balance and checkpointing, then train with the plan.

    python examples/plan_then_train.py --ranks 2 --memory-limit 512MiB

``fastpipe.plan`` profiles each layer once on this machine, simulates every
schedule x microbatch count x balance x checkpoint mode, and keeps the
fastest candidate whose every rank fits the memory limit; ``Pipe(plan=)``
takes its choices.
"""

from __future__ import annotations

import argparse

import torch

import fastpipe
from fastpipe import Pipe
from tiny_gpt import batch, gpt, loss_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--memory-limit", default=None, help="per rank, e.g. 2GiB (default: none)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--blocks", type=int, default=6)
    args = p.parse_args()

    model = gpt(width=args.width, blocks=args.blocks)
    x, y = batch(0, args.batch)
    plan = fastpipe.plan(model, x, args.ranks, memory_limit=args.memory_limit,
                         param_scale=4.0,  # parameter, gradient and AdamW's two states
                         loss_fn=loss_fn, target=y)  # the loss's time and memory, last stage
    plan.explain(top=5)
    print(f"chosen: {plan.schedule}, {plan.chunks} chunks, balance {plan.balance}, "
          f"checkpoint {plan.checkpoint}")
    pipe = Pipe(model, plan=plan, devices=["cpu"] * args.ranks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        x, y = batch(step, args.batch)
        optimizer.zero_grad()
        loss = pipe.step(x, y, loss_fn)
        optimizer.step()
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    pipe.close()


if __name__ == "__main__":
    main()
