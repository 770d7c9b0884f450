"""``python -m bench [NAME] [args]``: runs one benchmark (default: pipelining)."""

import sys

from bench import pipelining

BENCHES = {"pipelining": pipelining.main}

if __name__ == "__main__":
    argv = sys.argv[1:]
    name = argv.pop(0) if argv and argv[0] in BENCHES else "pipelining"
    raise SystemExit(BENCHES[name](argv))
