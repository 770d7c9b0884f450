"""``python -m fastpipe``: the command-line interface (see fastpipe._cli)."""

from fastpipe._cli import main

__all__: list[str] = []

raise SystemExit(main())
