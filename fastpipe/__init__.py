"""fastpipe: pipeline-parallel training for PyTorch.

    from fastpipe import Pipe
    pipe = Pipe(model, chunks=8, schedule="zbv", devices=["cpu", "cpu"])
    loss = pipe.step(x, target, loss_fn)

Importing this package runs nothing (not even ``import torch``): the public
names load on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastpipe._version import __version__

if TYPE_CHECKING:  # what checkers and IDEs see; at run time each loads on first access
    from fastpipe import balance, hf, kernels, schedules
    from fastpipe._plan import Plan, plan
    from fastpipe._state import state_dict
    from fastpipe.kernels.recompute import selective_recompute
    from fastpipe.pipe import Pipe
    from fastpipe.runtime.checkpoint import is_recomputing
    from fastpipe.runtime.deferred import WeightRule, register_weight_rule
    from fastpipe.runtime.packing import Layout, pack, unpack
    from fastpipe.runtime.transport import PeerError
    from fastpipe.schedules import ScheduleError

__all__ = [
    "Layout", "PeerError", "Pipe", "Plan", "ScheduleError", "WeightRule", "__version__", "balance",
    "hf", "is_recomputing", "kernels", "pack", "plan", "register_weight_rule", "schedules",
    "selective_recompute", "state_dict", "unpack",
]

_LAZY = {
    "Pipe": "fastpipe.pipe",
    "is_recomputing": "fastpipe.runtime.checkpoint",
    "selective_recompute": "fastpipe.kernels.recompute",
    "pack": "fastpipe.runtime.packing",
    "unpack": "fastpipe.runtime.packing",
    "Layout": "fastpipe.runtime.packing",
    "plan": "fastpipe._plan",
    "Plan": "fastpipe._plan",
    "WeightRule": "fastpipe.runtime.deferred",
    "register_weight_rule": "fastpipe.runtime.deferred",
    "state_dict": "fastpipe._state",
    "PeerError": "fastpipe.runtime.transport",
    "ScheduleError": "fastpipe.schedules",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in ("balance", "hf", "kernels", "schedules", "runtime"):
        return importlib.import_module(f"fastpipe.{name}")
    raise AttributeError(f"module 'fastpipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
