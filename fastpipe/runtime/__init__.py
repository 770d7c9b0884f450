"""Runs actions: the native lane ring and, on top of it, the executor.

``HostRing``, ``Event`` and ``SlotRing`` come from the native extension and are loaded on
first access, so importing this package does not load ``fastpipe._C``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Event", "HostRing", "SlotRing", "cuda_status"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fastpipe._ext import native

        return getattr(native(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
