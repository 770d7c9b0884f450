"""The one place that loads the native extension ``fastpipe._C``.

Loading is lazy (nothing happens at ``import fastpipe``) and a missing or broken
build turns into a single ImportError that says how to fix it.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

__all__ = ["native", "native_chain"]


@functools.cache
def native() -> ModuleType:
    """Returns ``fastpipe._C``, importing it on first use.

    Raises:
        ImportError: the extension is missing or does not load; the message names
            the fix.
    """
    try:
        return importlib.import_module("fastpipe._C")
    except ImportError as err:
        raise ImportError(
            f"fastpipe's native extension fastpipe._C could not be loaded ({err}). "
            "Build it with `pip install -e .` in the fastpipe source tree "
            "(or reinstall fastpipe)."
        ) from err


# What this Python calls of fastpipe._chain: csrc/chain/chain.cpp's
# ``interface``, raised with any change to what the module offers.
CHAIN_INTERFACE = 2


@functools.cache
def native_chain() -> ModuleType | None:
    """Returns ``fastpipe._chain`` (chains in C++, built against torch), or None.

    None where it was not built (no torch at build time), does not load
    (built against another torch) or was built from other sources (its
    ``interface`` is not ``CHAIN_INTERFACE``): the Python paths run then.
    """
    try:
        module = importlib.import_module("fastpipe._chain")
    except ImportError:
        return None
    return module if getattr(module, "interface", None) == CHAIN_INTERFACE else None
