"""fastpipe against another fastpipe: this tree's step times next to another checkout's.

A regression check needs both versions on the same machine at the same time: on a shared
2-core VM a step moves by ±5-15 % between runs, more than most regressions. So every round
runs the other tree, then this one, each in fresh processes, and the report gives the
median over rounds of each tree's median step, and their ratio. The workloads are this
tree's (``bench._workloads``: GPT and MLP, compute- and overhead-bound), built the same way
for both; only ``fastpipe`` comes from each tree. The other tree must be built
(``python setup.py build_ext --inplace`` there, with this environment's torch).

    python -m bench against --tree PATH [--model gpt|mlp|both] [--workload compute|overhead|both]
                            [--mode dist|local|both] [--schedules 1f1b,zb-h2,gpipe]
                            [--rounds 3] [--steps 15]

Distributed: 2 gloo ranks (``torch.distributed.run``), one thread each, every step behind a
barrier; local: ``devices=["cpu", "cpu"]`` in one process, ``OMP_NUM_THREADS=1``. Both trees
run the split ``bench pipelining`` gives each schedule, worked out once here (two stages a
rank for the interleaved and V schedules).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # this tree


def _worker(root: str, names: list[str], schedules: list[str], steps: int, local: bool,
            balances: dict) -> None:
    """In a fresh process: this tree's workloads, ``root``'s fastpipe, the
    splits ``balances`` (``"workload schedule"``: layers per stage); prints
    one JSON line."""
    sys.path.insert(0, str(HERE))
    from bench._workloads import WORKLOADS  # imports no fastpipe

    sys.path.remove(str(HERE))
    sys.path.insert(0, root)
    import time

    import torch
    import torch.distributed as dist

    from fastpipe import Pipe

    if Path(sys.modules["fastpipe"].__file__).resolve().parent.parent != Path(root).resolve():
        raise SystemExit(f"fastpipe came from {sys.modules['fastpipe'].__file__}, not {root}")
    torch.set_num_threads(1)
    if not local:
        dist.init_process_group("gloo")
    out = {}
    for name in names:
        w = WORKLOADS[name]
        x, y = w.data()
        for schedule in schedules:
            kw = dict(devices=["cpu", "cpu"]) if local else {}
            bal = balances[f"{name} {schedule}"]
            pipe = Pipe(w.build(), chunks=w.chunks, schedule=schedule, balance=bal,
                        stages_per_rank=len(bal) // 2, **kw)
            for _ in range(4):
                pipe.step(x, y, w.loss_fn)
            times = []
            for _ in range(steps):
                if not local:
                    dist.barrier()
                t0 = time.perf_counter()
                pipe.step(x, y, w.loss_fn)
                times.append(time.perf_counter() - t0)
            out[f"{name} {schedule}"] = statistics.median(times)
            pipe.close()
    if local or dist.get_rank() == 0:
        print("AGAINST " + json.dumps(out), flush=True)
    if not local:
        dist.destroy_process_group()


def _names(args) -> list[str]:
    return [f"{m}-{s}" for m in (["gpt", "mlp"] if args.model == "both" else [args.model])
            for s in (["compute", "overhead"] if args.workload == "both" else [args.workload])]


def _balances(args) -> dict:
    from bench._workloads import WORKLOADS
    from bench.pipelining import balance

    return {f"{name} {s}": balance(WORKLOADS[name], s) for name in _names(args)
            for s in args.schedules.split(",")}


def _run(root: Path, args, local: bool, balances: dict) -> dict:
    worker = [str(Path(__file__).resolve()), "--worker", str(root), ",".join(_names(args)),
              args.schedules, str(args.steps), json.dumps(balances)] + (["--local"] if local else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable] + worker if local else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(args.port)] + worker
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("AGAINST "):
            return json.loads(line[len("AGAINST "):])
    raise SystemExit(f"{root} ({'local' if local else 'distributed'}) failed:\n{done.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench against", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", required=True, help="the other fastpipe checkout (built)")
    parser.add_argument("--model", choices=["gpt", "mlp", "both", "hf-gpt2", "hf-llama"], default="mlp")
    parser.add_argument("--workload", choices=["compute", "overhead", "both"], default="both")
    parser.add_argument("--mode", choices=["dist", "local", "both"], default="both")
    parser.add_argument("--schedules", default="1f1b,zb-h2,gpipe")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--port", type=int, default=29631)
    args = parser.parse_args(argv)
    other = Path(args.tree).resolve()
    if not (other / "fastpipe" / "__init__.py").is_file():
        raise SystemExit(f"--tree {args.tree!r} holds no fastpipe package")
    modes = {"dist": [False], "local": [True], "both": [False, True]}[args.mode]
    balances = _balances(args)
    for local in modes:
        runs: dict = {"other": [], "this": []}
        for _ in range(args.rounds):
            runs["other"].append(_run(other, args, local, balances))
            runs["this"].append(_run(HERE, args, local, balances))
        print(f"\n{'local mode' if local else '2 gloo ranks'}: median of {args.rounds} rounds, "
              f"each the median of {args.steps} steps; other = {other}")
        print(f"  {'workload schedule':<28}{'other ms':>10}{'this ms':>10}{'this/other':>12}")
        for key in runs["this"][0]:
            a = statistics.median(r[key] for r in runs["other"]) * 1e3
            b = statistics.median(r[key] for r in runs["this"]) * 1e3
            print(f"  {key:<28}{a:>10.2f}{b:>10.2f}{b / a:>12.3f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        root, names, schedules, steps, splits = sys.argv[2:7]
        _worker(root, names.split(","), schedules.split(","), int(steps), "--local" in sys.argv,
                json.loads(splits))
    else:
        raise SystemExit(main())
