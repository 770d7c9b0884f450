"""``python -m fastpipe demo``: the main job.

1. Compares every registered schedule in the simulator (4 ranks, 8 microbatches).
2. Trains a small regression MLP on synthetic data with a real two-rank CPU
   pipeline in distributed mode: it spawns two processes that talk gloo on
   127.0.0.1. Prints a progress bar, the loss going down and samples/s; then
   records one step and prints its measured bubble ratio next to the one the
   simulator predicts from the measured per-action costs, and writes that
   step as a Chrome trace and a PNG under ``out/``.
"""

from __future__ import annotations

import sys
import time

__all__ = ["run"]


def _compare_schedules(ranks: int = 4, microbatches: int = 8) -> None:
    from fastpipe._cli import build_parser

    print(f"simulated schedules, {ranks} ranks x {microbatches} microbatches "
          "(per rank F=1, B=2, I=W=1, split evenly over its stages):")
    # `fastpipe simulate --compare` as the shell runs it: every option has its default.
    args = build_parser().parse_args(["simulate", "--compare", "--ranks", str(ranks),
                                      "--microbatches", str(microbatches)])
    args.run(args)


def _bar(done: int, total: int, width: int = 28) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def _model():
    from torch import nn

    # Four h x h layers, so each of ZBV's four stages gets one (balanced by
    # parameter count); with three, one stage would hold only the small ones.
    d, h = 128, 1024
    return nn.Sequential(
        nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(),
        nn.Linear(h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, 1),
    )


def _data(step: int, batch: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    w = torch.randn(128, 1, generator=torch.Generator().manual_seed(0)) / 128**0.5
    x = torch.randn(batch, 128, generator=g)
    return x, x @ w + 0.1 * torch.sin(3 * x[:, :1])


def _rank_main(rank: int, world: int, init: str, queue, cfg: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from fastpipe import Pipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = _model()
        # Each rank keeps only its own stages' weights (the optimizer comes after the Pipe).
        pipe = Pipe(model, chunks=cfg["chunks"], schedule=cfg["schedule"], timeout=60, free_remote=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses, start = [], None
        for step in range(1, cfg["steps"] + 1):
            if step == 3:  # the first steps warm up allocators: time the rest
                dist.barrier()
                start = time.perf_counter()
            x, y = _data(step, cfg["batch"])
            opt.zero_grad()
            loss = pipe.step(x, y, nn.functional.mse_loss).item()
            opt.step()
            losses.append(loss)
            if rank == 0:
                rate = ""
                if start is not None:  # steps from 3 on are timed
                    rate = f"  {(step - 2) * cfg['batch'] / (time.perf_counter() - start):,.0f} samples/s"
                _progress(step, cfg["steps"], f"loss {loss:.4f}{rate}")
        elapsed = time.perf_counter() - start
        x, y = _data(0, cfg["batch"])
        _, sim = pipe.step_with_timeline(x, y, nn.functional.mse_loss)
        queue.put((rank, {"losses": losses, "elapsed": elapsed, "sim": sim if rank == 0 else None}))
    finally:
        dist.destroy_process_group()


def _progress(step: int, steps: int, text: str, out=None) -> None:
    """A bar redrawn in place on a terminal; into a log or a pipe, one plain
    line every tenth of the run (no carriage returns)."""
    out = out or sys.stdout
    if out.isatty():
        out.write(f"\r  {_bar(step, steps)} {text}   " + ("\n" if step == steps else ""))
    elif step % max(1, steps // 10) == 0 or step == steps:
        out.write(f"  step {step}/{steps} {text}\n")
    out.flush()


def _stage_costs(sim) -> dict[str, list[float]]:
    """Mean measured ms of each action kind, per stage (the simulator's
    kind -> per-stage costs): stages differ, and one mean per kind would
    hide the imbalance that makes a real step's bubble."""
    totals: dict[str, dict[int, list[float]]] = {}
    for rec in sim.timeline:
        if rec.track == "compute":
            per = totals.setdefault(rec.action.kind.value, {})
            per.setdefault(rec.action.stage, []).append(rec.end - rec.start)
    stages = sim.schedule.stages
    return {k: [sum(per[s]) / len(per[s]) for s in range(stages)] for k, per in totals.items()}


def _train(steps: int = 25, chunks: int = 8, batch: int = 256, schedule: str = "zbv") -> None:
    import os

    from fastpipe._plan import _cost_fn
    from fastpipe._spawn import spawn
    from fastpipe.schedules import Kind, build

    print(f"\ntraining a {len(_model())}-layer MLP with schedule {schedule!r} on 2 gloo ranks (127.0.0.1), "
          f"{chunks} microbatches of {batch // chunks} rows:")
    cfg = {"steps": steps, "chunks": chunks, "batch": batch, "schedule": schedule}
    results = spawn(2, _rank_main, cfg, timeout=600)
    losses, sim = results[0]["losses"], results[0]["sim"]
    rate = (steps - 2) * batch / results[0]["elapsed"]
    print(f"\n  loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps; {rate:,.0f} samples/s")
    costs = _stage_costs(sim)
    plan_sched = build(schedule, 2, chunks)
    predicted = plan_sched.simulate(costs)
    sends = [r.end - r.start for r in sim.timeline
             if r.track == "comm" and r.action.kind in (Kind.SEND_F, Kind.SEND_B)]
    send_ms = sum(sends) / len(sends) if sends else 0.0
    # fastpipe.plan's model: every message end costs its rank this much time.
    charged = plan_sched.simulate(_cost_fn(costs, "never", chunks, plan_sched, send_ms))
    print(f"  recorded step: {sim.makespan:.1f} ms, measured bubble {sim.bubble_ratio:.3f} vs "
          f"simulated {predicted.bubble_ratio:.3f} ({predicted.makespan:.1f} ms), from the measured "
          "mean ms of each action kind per stage: "
          + ", ".join(f"{k}=" + "/".join(f"{c:.2f}" for c in v) for k, v in sorted(costs.items())))
    print(f"  that simulation moves messages for free; charging each message end the measured "
          f"{send_ms:.2f} ms of a send (fastpipe.plan's model) it predicts {charged.makespan:.1f} ms "
          f"for the {sim.makespan:.1f} ms step")
    os.makedirs("out", exist_ok=True)
    trace = sim.to_chrome_trace("out/demo_trace.json")
    print(f"  Chrome trace of that step (compute and comm tracks per rank): {trace}")
    try:
        sim.plot("out/demo_timeline.png")
        print("  timeline picture: out/demo_timeline.png")
    except ImportError as err:
        print(f"  (no picture: {err})")


def run() -> int:
    _compare_schedules()
    _train()
    return 0
