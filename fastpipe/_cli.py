"""The ``fastpipe`` command line: ``demo`` and ``simulate``.

The CLI prints; the library logs. Each subcommand lives in a small function
that builds its parser and one that runs it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job: compare schedules and run a pipeline")
    demo.set_defaults(run=_run_demo)
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from fastpipe._demo import run

    return run()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
