"""The ``fastpipe`` command line: ``demo``, ``simulate`` and ``plan``.

The CLI prints; the library logs. Each subcommand lives in a small function
that builds its parser and one that runs it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastpipe.schedules import Schedule

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job: compare schedules and run a pipeline")
    demo.set_defaults(run=_run_demo)
    _add_simulate_parser(sub)
    _add_plan_parser(sub)
    return parser


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="profile a model and rank schedule x chunks x balance plans",
        description="Profile MODULE:FACTORY's layers and print the best pipeline plans.",
    )
    plan.add_argument("--model", required=True,
                      help="MODULE:FACTORY; FACTORY() returns an nn.Sequential, or (model, sample)")
    plan.add_argument("--ranks", type=_positive_int, default=2, help="pipeline ranks (2)")
    plan.add_argument("--input-shape", type=_parse_shape, default=None,
                      help="sample batch shape, e.g. 64,512 (random fp32), if FACTORY gives no sample")
    plan.add_argument("--memory-limit", default=None, help="per rank, e.g. 2GiB or 512MB")
    plan.add_argument("--param-scale", type=float, default=2.0,
                      help="parameter copies per rank (2: param + grad; 4 with Adam)")
    plan.add_argument("--top", type=_positive_int, default=10, help="rows to print (10)")
    plan.set_defaults(run=_run_plan, parser=plan)


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape):
        raise argparse.ArgumentTypeError(f"expected a shape like 64,512, got {text!r}")
    return shape


def _load_factory(spec: str):
    import importlib

    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--model must look like MODULE:FACTORY, got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {exc}") from exc


def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from fastpipe._plan import parse_bytes, plan

    try:
        made = _load_factory(args.model)()
        model, sample = made if isinstance(made, tuple) else (made, None)
        if sample is None:
            if args.input_shape is None:
                raise ValueError(f"{args.model} returns no sample: pass --input-shape")
            dtype = next((p.dtype for p in model.parameters()), torch.float32)
            sample = torch.randn(args.input_shape, dtype=dtype)
        result = plan(model, sample, args.ranks, parse_bytes(args.memory_limit),
                      param_scale=args.param_scale)
    except ValueError as exc:
        args.parser.error(str(exc))
    print(f"plans for {args.model} on {args.ranks} ranks, batch {tuple(sample.shape)}, "
          f"profiled on cpu (predicted step times from the simulator):")
    result.explain(args.top)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from fastpipe._demo import run

    return run()


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    from fastpipe.schedules import names

    simulate = sub.add_parser(
        "simulate",
        help="simulate a schedule: grid, bubble ratio, peak in-flight (no process group)",
        description="Simulate a pipeline schedule on a model of time (pure Python).",
    )
    simulate.add_argument("--schedule", choices=names(), help="the schedule to simulate")
    simulate.add_argument("--ranks", type=_positive_int, default=4, help="pipeline ranks (4)")
    simulate.add_argument("--microbatches", type=_positive_int, default=8, help="microbatches (8)")
    simulate.add_argument(
        "--stages-per-rank",
        type=_positive_int,
        default=None,
        help="stages (model chunks) per rank; default: the schedule's",
    )
    simulate.add_argument(
        "--costs",
        type=_parse_costs,
        default=None,
        help="per-kind costs of one rank's share of the model, e.g. "
        "F=1,B=2,W=1 (defaults F=1,B=2,I=1,W=1); a schedule with v stages "
        "per rank costs 1/v of that per stage, so schedules compare fairly",
    )
    simulate.add_argument("--png", help="write the timeline as a PNG (needs matplotlib)")
    simulate.add_argument("--trace", help="write a Chrome/Perfetto trace (1 unit = 1 ms)")
    simulate.add_argument(
        "--compare",
        action="store_true",
        help="one line per schedule that can be built, by makespan",
    )
    simulate.set_defaults(run=_run_simulate, parser=simulate)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _parse_costs(text: str) -> dict[str, float]:
    costs: dict[str, float] = {}
    for item in text.split(","):
        kind, sep, number = item.partition("=")
        kind = kind.strip().upper()
        try:
            value = float(number) if sep else float("nan")
        except ValueError:
            value = float("nan")
        if kind not in ("F", "B", "I", "W") or not value >= 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(
                f"invalid costs {text!r}: expected KIND=NUMBER pairs separated by commas, "
                f"KIND one of F, B, I, W and NUMBER >= 0 (e.g. F=1,B=2,W=1); bad item {item!r}"
            )
        costs[kind] = value
    return costs


def _run_simulate(args: argparse.Namespace) -> int:
    from fastpipe.schedules import build

    if args.compare:
        return _run_compare(args)
    if args.schedule is None:
        args.parser.error("--schedule is required unless --compare is given")
    try:
        schedule = build(args.schedule, args.ranks, args.microbatches, args.stages_per_rank)
        schedule.validate()
        sim = schedule.simulate(_per_stage(args.costs, schedule))
    except ValueError as exc:
        args.parser.error(str(exc))
    print(schedule.render_text())
    print(f"makespan: {sim.makespan:g}")
    print(f"bubble ratio: {sim.bubble_ratio:.4f}")
    print(f"peak in-flight per rank: {sim.peak_inflight}")
    if args.png:
        try:
            print(f"wrote {sim.plot(args.png)}")
        except ImportError as exc:
            args.parser.error(str(exc))
    if args.trace:
        print(f"wrote {sim.to_chrome_trace(args.trace)}")
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from fastpipe.schedules import build, names

    rows = []
    for name in names():
        try:
            schedule = build(name, args.ranks, args.microbatches, args.stages_per_rank)
        except ValueError:
            continue  # this schedule cannot take these parameters
        rows.append((schedule.simulate(_per_stage(args.costs, schedule)), schedule))
    rows.sort(key=lambda row: (row[0].makespan, row[1].name))
    print(
        f"{'schedule':<18} {'v':>2} {'makespan':>9} {'bubble':>7}  "
        "peak in-flight (stage-microbatches)"
    )
    for sim, schedule in rows:
        v = schedule.stages // schedule.ranks
        print(
            f"{schedule.name:<18} {v:>2} {sim.makespan:>9g} {sim.bubble_ratio:>7.4f}  "
            f"{sim.peak_inflight}"
        )
    return 0


def _per_stage(costs: dict[str, float] | None, schedule: Schedule) -> dict[str, float]:
    """Costs of one stage: a rank's share of the model split over its stages."""
    v = schedule.stages // schedule.ranks
    given = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0} if costs is None else costs
    return {kind: value / v for kind, value in given.items()}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
