"""What a pipeline saves and loads: the model's state dict, each tensor once,
split by the layers a process holds.

A checkpoint of a pipeline is written by every rank at once (with
``torch.distributed.checkpoint``), each rank giving the entries of its own
stages under the names the unsplit ``nn.Sequential`` gives them. Names, not
ranks, identify an entry, so the same checkpoint loads into the plain model
or a pipeline of another schedule or width. A tensor that several layers
share (a tied embedding and head) is kept under its first name in
``model.state_dict()`` order only: each rank that holds it offers it under
that name, whichever of its layers it holds, and the checkpoint stores it
once. ``state_dict(model)`` gives the same names for the plain model, which
is what loading a pipeline checkpoint into it needs (``model.state_dict()``
would also ask for the second name).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

__all__ = ["held_state_dict", "load_held", "state_dict"]


def state_dict(model: nn.Module, keep_vars: bool = False) -> dict[str, Any]:
    """``model.state_dict()`` with each shared tensor once, under its first name.

    The keys a fastpipe checkpoint holds. The values are the model's own
    tensors (detached unless ``keep_vars``): ``torch.distributed.checkpoint.load``
    into this dict loads the model in place.
    """
    full = model.state_dict(keep_vars=keep_vars)
    first = _first_names(model)
    return {name: value for name, value in full.items() if first[name] == name}


def held_state_dict(model: nn.Sequential, layers: Collection[int], destination: dict | None = None,
                    prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
    """The entries of ``model``'s layers ``layers`` (indices), each tensor once
    under its first name in the whole model, so that a tensor tied between a
    held layer and another one gets the name every rank uses for it."""
    full = model.state_dict(keep_vars=keep_vars)
    first = _first_names(model)
    held = _held_names(model, layers, full)
    out = destination if destination is not None else {}
    for name in held:
        out.setdefault(prefix + first[name], full[name])
    return out


def load_held(model: nn.Sequential, layers: Collection[int], loaded: Mapping[str, Any],
              strict: bool, assign: bool) -> _IncompatibleKeys:
    """Loads the entries of ``model``'s layers ``layers`` from ``loaded``.

    ``loaded`` may hold the whole model's entries or only these layers';
    a shared tensor may come under any of its names. Entries of layers held
    elsewhere are skipped (they are not unexpected); a name the model does
    not have is.

    Returns:
        torch's ``(missing_keys, unexpected_keys)``: held entries ``loaded``
        lacks (by first name), and names the model does not have.

    Raises:
        RuntimeError: ``strict`` and some key is missing or unexpected (torch's
            message), or a shape differs (from ``nn.Module.load_state_dict``).
    """
    full = model.state_dict(keep_vars=True)
    first = _first_names(model)
    held = _held_names(model, layers, full)
    wanted = {first[name] for name in held}
    via = {}  # first name -> a name of it in a held layer: loaded through a module this rank runs
    for name in held:
        via.setdefault(first[name], name)
    unexpected = [k for k in loaded if k not in first]
    given = {first[k] for k in loaded if k in first}
    missing = [name for name in dict.fromkeys(first[n] for n in held) if name not in given]
    if strict and (missing or unexpected):
        parts = []
        if unexpected:
            parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected))
        if missing:
            parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing))
        raise RuntimeError("Error(s) in loading state_dict for Pipe:\n\t" + "\n\t".join(parts))
    if assign:  # a new object in one place would leave the others holding the old one
        places: dict[int, list[str]] = {}
        for name, t in full.items():
            places.setdefault(id(t), []).append(name)
        tied = next((names for names in places.values()
                     if len(names) > 1 and any(n in held for n in names)), None)
        if tied is not None:
            raise ValueError(f"load_state_dict(assign=True) would untie {' and '.join(tied)} (one "
                             "tensor, held in both places): load with assign=False, which "
                             "copies into it")
    picked: dict[str, Any] = {}
    for key, value in loaded.items():
        name = first.get(key)
        if name in wanted and (via[name] not in picked or key == name):
            picked[via[name]] = value  # under its first name, if given twice
    # The modules' state-dict versions, as loaded (else the model's own): without
    # them a module takes its old-checkpoint path (BatchNorm fills a missing
    # num_batches_tracked with the one it holds).
    chosen = OrderedDict(picked)
    chosen._metadata = getattr(loaded, "_metadata", None) or getattr(full, "_metadata", None)
    model.load_state_dict(chosen, strict=False, assign=assign)
    return _IncompatibleKeys(missing, unexpected)


def _first_names(model: nn.Module) -> dict[str, str]:
    """Every ``model.state_dict()`` name -> the first name of the same tensor."""
    first: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        key = id(value) if isinstance(value, torch.Tensor) else id(name)
        first[name] = seen.setdefault(key, name)
    return first


def _held_names(model: nn.Sequential, layers: Collection[int], full: Mapping[str, Any]) -> list[str]:
    """The names in ``full`` that belong to the layers ``layers`` of ``model``."""
    children = {name: i for i, name in enumerate(model._modules)}
    return [name for name in full if children.get(name.split(".", 1)[0]) in layers]
