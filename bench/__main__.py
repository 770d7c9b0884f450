"""``python -m bench [NAME] [args]``: runs one benchmark (default: pipelining)."""

import sys

from bench import (against, iw_split, local, memory, packing, pipelining, plan, recompute, stages,
                   timeline)

BENCHES = {"pipelining": pipelining.main, "iw_split": iw_split.main, "recompute": recompute.main,
           "packing": packing.main, "plan": plan.main,
           "local": local.main, "against": against.main, "timeline": timeline.main,
           "memory": memory.main, "stages": stages.main}

if __name__ == "__main__":
    argv = sys.argv[1:]
    name = argv.pop(0) if argv and argv[0] in BENCHES else "pipelining"
    raise SystemExit(BENCHES[name](argv))
