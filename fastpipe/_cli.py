"""The ``fastpipe`` command line: ``demo``, ``simulate``, ``plan`` and ``info``.

The CLI prints; the library logs. Each subcommand lives in a small function
that builds its parser and one that runs it; ``main`` turns a closed stdout
into a quiet exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from fastpipe._version import __version__

if TYPE_CHECKING:
    from fastpipe.schedules import Action, Schedule

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastpipe",
        description="Pipeline-parallel training for PyTorch: compare schedules, "
        "plan how to split a model, check an install.",
    )
    parser.add_argument("--version", action="version", version=f"fastpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="compare the schedules, then train a small model on a two-process CPU pipeline",
        description="Compare the schedules in the simulator, then train a small model on a "
        "two-process CPU pipeline and write one step's timeline under out/.",
    )
    demo.set_defaults(run=_run_demo)
    _add_simulate_parser(sub)
    _add_plan_parser(sub)
    info = sub.add_parser(
        "info",
        help="print the versions and native extensions in use (for bug reports)",
        description="Print fastpipe's, Python's and torch's versions, the CUDA runtime and "
        "which of fastpipe's native extensions load.",
    )
    info.set_defaults(run=_run_info)
    return parser


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="suggest the fastest schedule, microbatch count and layer split for your model",
        description="Time your model's layers on this machine and print the fastest pipeline "
        "plans (schedule, microbatches, layers per stage) that fit the memory limit.",
    )
    plan.add_argument("--model", required=True,
                      help="MODULE:FACTORY; FACTORY() returns an nn.Sequential, (model, sample), "
                      "or (model, sample, target)")
    plan.add_argument("--loss", default=None, metavar="MODULE:FN",
                      help="the step's loss_fn(output, target), timed and walked with the last "
                      "stage (FACTORY must give the target); without it the plans leave the "
                      "loss out")
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


def _load(spec: str, flag: str = "--model", what: str = "FACTORY"):
    """The object ``MODULE:NAME`` names (``flag`` and ``what`` word the error)."""
    import importlib

    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{flag} must look like MODULE:{what}, got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {exc}") from exc


def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from fastpipe._plan import parse_bytes, plan

    try:
        made = _load(args.model)()
        made = made if isinstance(made, tuple) else (made,)
        if not 1 <= len(made) <= 3:
            raise ValueError(f"{args.model} returned {len(made)} values; expected a model, "
                             "(model, sample) or (model, sample, target)")
        model, sample, target = (*made, None, None)[:3]
        loss_fn = _load(args.loss, "--loss", "FN") if args.loss is not None else None
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"--loss {args.loss} is a {type(loss_fn).__name__}, not a function")
        if loss_fn is not None and target is None:
            raise ValueError(f"--loss needs a target: {args.model} must return (model, sample, target)")
        if loss_fn is None:
            target = None  # the loss is left out without --loss
        if sample is None:
            if args.input_shape is None:
                raise ValueError(f"{args.model} returns no sample: pass --input-shape")
            dtype = next((p.dtype for p in model.parameters()), torch.float32)
            sample = torch.randn(args.input_shape, dtype=dtype)
        result = plan(model, sample, args.ranks, parse_bytes(args.memory_limit),
                      param_scale=args.param_scale, loss_fn=loss_fn, target=target)
    except ValueError as exc:
        args.parser.error(str(exc))
    print(f"plans for {args.model} on {args.ranks} ranks, batch {tuple(sample.shape)}, "
          f"profiled on cpu{' with ' + args.loss if loss_fn is not None else ''} "
          "(predicted step times from the simulator):")
    result.explain(args.top)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from fastpipe._demo import run

    return run()


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    from fastpipe.schedules import names

    simulate = sub.add_parser(
        "simulate",
        help="show a schedule's timeline and bubble for given per-action costs",
        description="Show the order in which a pipeline schedule runs its actions on each "
        "rank, its makespan, its bubble (idle share) and the activations each rank holds at "
        "most, for per-action costs you give. Nothing runs on a device.",
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
        metavar="KIND=COST,...",
        help="cost of each action kind on one rank's share of the model, e.g. F=1,B=2 "
        "(forward, backward, input-grad, weight-grad; defaults F=1,B=2,I=1,W=1, and a "
        "missing B is I+W); with v stages per rank each stage costs 1/v of that, so "
        "schedules compare fairly",
    )
    simulate.add_argument(
        "--by-cost",
        action="store_true",
        help="zb-h1, zb-h2 and zbv in the order their list scheduler picks for --costs "
        "(what plan and balance='auto' may run) instead of the built-in order",
    )
    simulate.add_argument(
        "--lean",
        action="store_true",
        help="zb-h1, zb-h2 and zbv with their F-to-W cap at the F-to-I cap, so what the weight "
        "pass reads waits no longer than the activations (build(lean=True): less memory, a "
        "little more bubble)",
    )
    simulate.add_argument(
        "--png", metavar="FILE", help="write the timeline to this PNG (needs matplotlib)"
    )
    simulate.add_argument(
        "--trace",
        metavar="FILE",
        help="write the timeline to this Chrome/Perfetto trace (1 cost unit = 1 ms)",
    )
    simulate.add_argument(
        "--compare",
        action="store_true",
        help="list every schedule that fits --ranks and --microbatches, fastest first",
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
    if args.compare:
        if args.png or args.trace:
            args.parser.error(
                "--png and --trace draw one schedule: pass --schedule NAME instead of --compare"
            )
        return _run_compare(args)
    if args.schedule is None:
        args.parser.error("--schedule is required unless --compare is given")
    try:
        schedule = _built(args.schedule, args)
        schedule.validate()
        sim = schedule.simulate(_per_stage(args.costs, schedule))
    except ValueError as exc:
        args.parser.error(str(exc))
    print(schedule.render_text())
    print("(the grid gives every action one step; makespan and bubble ratio use the costs)")
    print(f"makespan: {sim.makespan:g}")
    print(f"bubble ratio: {sim.bubble_ratio:.4f}")
    print(f"peak in-flight per rank: {sim.peak_inflight}")
    if sim.peak_held != sim.peak_inflight:
        print(f"peak held until W per rank: {sim.peak_held} (what the weight pass reads waits too)")
    for path, write in ((args.png, sim.plot), (args.trace, sim.to_chrome_trace)):
        if path:
            try:
                write(path)
            except ImportError as exc:
                args.parser.error(str(exc))
            except OSError as exc:
                print(f"fastpipe: error: cannot write {path}: {exc.strerror or exc}",
                      file=sys.stderr)
                return 1
            print(f"wrote {path}")
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from fastpipe.schedules import names

    rows = []
    for name in names():
        try:
            schedule = _built(name, args)
        except ValueError:
            continue  # this schedule cannot take these parameters
        rows.append((schedule.simulate(_per_stage(args.costs, schedule)), schedule))
    rows.sort(key=lambda row: (row[0].makespan, row[1].name))
    print(
        f"{'schedule':<18} {'v':>2} {'makespan':>9} {'bubble':>7}  "
        "peak in-flight, then held until W where more (stage-microbatches)"
    )
    for sim, schedule in rows:
        v = schedule.stages // schedule.ranks
        held = f"  {sim.peak_held}" if sim.peak_held != sim.peak_inflight else ""
        print(
            f"{schedule.name:<18} {v:>2} {sim.makespan:>9g} {sim.bubble_ratio:>7.4f}  "
            f"{sim.peak_inflight}{held}"
        )
    return 0


def _built(name: str, args: argparse.Namespace) -> Schedule:
    """The schedule ``name`` as the command line asks for it (``--by-cost``:
    ordered for ``--costs``; ``--lean``: its lean order)."""
    from fastpipe.schedules import build, orders_by_cost

    lean = bool(getattr(args, "lean", False)) and orders_by_cost(name)
    schedule = build(name, args.ranks, args.microbatches, args.stages_per_rank, lean=lean)
    if args.by_cost and orders_by_cost(name):
        schedule = build(name, args.ranks, args.microbatches, args.stages_per_rank,
                         costs=_per_stage(args.costs, schedule), lean=lean)
    return schedule


def _per_stage(costs: dict[str, float] | None, schedule: Schedule) -> Callable[[Action], float]:
    """Cost of one action on one stage: a rank's share of the model split over its stages.

    ``costs`` are per rank; the kinds it leaves out take the simulator's
    defaults first (``compute_cost``), so a kind left out costs exactly what
    it would if given with its default value. Then each is divided by the
    stages per rank.
    """
    from fastpipe.schedules._costs import compute_cost

    v = schedule.stages // schedule.ranks
    per_rank = compute_cost(costs, schedule.stages)
    return lambda action: per_rank(action) / v


def _run_info(args: argparse.Namespace) -> int:
    from fastpipe._ext import native, native_chain

    rows = [("fastpipe", __version__),
            ("python", f"{platform.python_version()} ({sys.executable})")]
    try:
        import torch
    except ImportError:
        rows += [("torch", "not installed"), ("CUDA runtime", "unknown (no torch)")]
    else:
        available = "available" if torch.cuda.is_available() else "not available"
        cuda = torch.version.cuda or "none (torch built without CUDA)"
        rows += [("torch", torch.__version__), ("CUDA runtime", f"{cuda}, GPU {available}")]
    c_status = _extension_status("fastpipe._C", native)
    if c_status == "loaded":
        c_status += " (CUDA lanes built)" if native().has_cuda else " (CUDA lanes not built)"
    rows += [
        ("fastpipe._C", c_status),
        ("fastpipe._chain", _extension_status("fastpipe._chain", native_chain)),
        ("fastpipe._chain built against torch", _built_with_torch(native_chain)),
        ("triton", _installed_version("triton")),
        ("transformers", _installed_version("transformers")),
    ]
    source = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if c_status == "not built" and os.path.exists(os.path.join(source, "setup.py")):
        rows.append(("note", f"fastpipe is imported from the source tree {source}, which has no "
                             "built extensions: build them there (pip install --no-build-isolation "
                             "-e .) or run from another directory"))
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label + ':':<{width + 1}} {value}")
    return 0


def _extension_status(name: str, load: Callable[[], ModuleType | None]) -> str:
    """``loaded``, ``not built`` or ``failed (reason)``: extension ``name`` as ``load`` finds it."""
    if importlib.util.find_spec(name) is None:
        return "not built"
    try:
        if load() is None:  # native_chain() answers None without the reason:
            importlib.import_module(name)  # importing again raises it
            return "failed (built from other sources than this fastpipe's: rebuild it)"
    except ImportError as exc:
        return f"failed ({exc.__cause__ or exc})"
    return "loaded"


def _built_with_torch(load: Callable[[], ModuleType | None]) -> str:
    """The torch version ``fastpipe._chain`` was compiled against (setup.py records it)."""
    module = load()
    if module is None:
        return "-"
    return getattr(module, "built_with_torch", "not recorded (built before it was recorded)")


def _installed_version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Usage errors exit with status 2 (argparse). When the reader of stdout goes
    away (``fastpipe simulate --compare | head -1``) it stops quietly with status 1.
    """
    args = build_parser().parse_args(argv)
    try:
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe may show only here, with the output still buffered
    except BrokenPipeError:
        # Point stdout at devnull so the flush at interpreter exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return status
