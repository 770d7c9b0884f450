"""``python -m fastpipe demo``: the main job.

1. Compares every registered schedule in the simulator (4 ranks, 8 microbatches).
2. Trains a small regression MLP for a few dozen steps with a real two-rank
   CPU pipeline in local mode (``devices=["cpu", "cpu"]``) on synthetic data,
   printing the loss going down and samples/s, then checks the pipelined
   gradients against the unsplit model once.
"""

from __future__ import annotations

import sys
import time


def _compare_schedules(ranks: int = 4, microbatches: int = 8) -> None:
    from fastpipe.schedules import build, names

    costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    rows = []
    for name in names():
        sim = build(name, ranks, microbatches).simulate(costs)
        rows.append((sim.makespan, name, sim.bubble_ratio, sim.peak_inflight))
    print(f"simulated schedules, {ranks} ranks x {microbatches} microbatches (F=1, B=2, I=W=1):")
    print(f"  {'schedule':<18}{'makespan':>9}{'bubble':>9}  peak in-flight per rank")
    for makespan, name, bubble, peak in sorted(rows):
        print(f"  {name:<18}{makespan:>9.1f}{bubble:>9.3f}  {list(peak)}")


def _bar(done: int, total: int, width: int = 28) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def _train(steps: int = 40, chunks: int = 8, batch: int = 256) -> None:
    import torch
    from torch import nn

    from fastpipe import Pipe

    torch.manual_seed(0)
    torch.set_num_threads(1)
    d = 128
    true_w = torch.randn(d, 1) / d**0.5
    make = lambda: nn.Sequential(  # noqa: E731
        nn.Linear(d, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
        nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1),
    )
    model = make()
    pipe = Pipe(model, chunks=chunks, schedule="zbv", devices=["cpu", "cpu"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    print(f"\ntraining: {pipe!r}".replace("\n", "\n  "))
    first = last = None
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(batch, d)
        y = torch.sin(x @ true_w * 3)
        opt.zero_grad()
        loss = pipe.step(x, y, nn.functional.mse_loss).item()
        opt.step()
        first = loss if first is None else first
        last = loss
        rate = step * batch / (time.perf_counter() - start)
        sys.stdout.write(f"\r  {_bar(step, steps)} loss {loss:.4f}  {rate:,.0f} samples/s")
        sys.stdout.flush()
    print(f"\n  loss {first:.4f} -> {last:.4f} over {steps} steps")

    # One exactness check against the unsplit model.
    ref = make()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(batch, d), torch.randn(batch, 1)
    for m in (model, ref):
        m.zero_grad()
    pipe.step(x, y, nn.functional.mse_loss)
    ref_loss = sum(nn.functional.mse_loss(ref(a), b)
                   for a, b in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)))
    (ref_loss / chunks).backward()
    worst = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    print(f"  max |grad(pipeline) - grad(sequential)| = {worst:.2e}")
    pipe.close()


def run() -> int:
    _compare_schedules()
    _train()
    return 0
