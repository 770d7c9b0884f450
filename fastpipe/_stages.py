"""A Pipe's stages: which layers each holds, on which device, and what a
distributed rank keeps of the layers other ranks run (``free_remote``).

A model built on the meta device (``with torch.device("meta"):``) has no
data anywhere; each process makes only its own stages' tensors on their
devices, without values (``materialize``), so no rank ever holds the whole
model. The caller then writes them (a checkpoint, an initialization);
``unwritten`` tells the first step which ones nobody has written yet.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from fastpipe.runtime.executor import Stage

__all__ = ["Fresh", "build_stages", "changed_layer", "free_remote", "materialize", "meta_problem",
           "to_meta", "unwritten", "written"]

# Marks the meta tensors free_remote put in place of data it freed: never
# materialized again (their values are gone), unlike those of a model built
# on meta.
_RELEASED = "_fastpipe_released"
# Marks a tensor materialize made, with what Fresh keeps of it, until a check
# finds it written: a later Pipe over the same model checks it too.
_MADE = "_fastpipe_made"


class Fresh(NamedTuple):
    """A tensor ``materialize`` made: where it is, and what it was then (by
    id, not a reference: a load with ``assign=True`` must free it)."""

    name: str  # the model's name for it ("3.weight")
    module: nn.Module
    attr: str
    tensor_id: int
    nan: bool  # made filled with NaN (floating and complex dtypes)
    version: int
    data_ptr: int


def build_stages(layers: Sequence[nn.Module], ranges: Sequence[range], stage_to_rank: Sequence[int],
                 ranks: Sequence[int], devices: Sequence[torch.device], chains: str = "on"
                 ) -> tuple[dict[int, dict[int, Stage]], str | None, list[Fresh]]:
    """``({rank: {stage: Stage}}, problem, fresh)`` for the ranks ``ranks``
    (this process's), each stage's layers moved to its rank's device. Meta
    tensors of a model built on meta are made there first (``materialize``;
    ``fresh`` lists them); a layer holding tensors ``free_remote`` released
    is not moved, and ``problem`` says which, for the caller to raise on
    every rank (so is one that ``materialize`` cannot make). ``chains``: as
    ``Stage.chains``."""
    problem = None
    fresh: list[Fresh] = []
    stages: dict[int, dict[int, Stage]] = {}
    for rank in ranks:
        held = {}
        for s, owner in enumerate(stage_to_rank):
            if owner != rank:
                continue
            found = meta_problem(layers, ranges[s], released_only=True)
            if found is not None:
                problem = found
                continue
            try:
                fresh += materialize(layers, ranges[s], devices[rank])
            except (ValueError, RuntimeError) as exc:  # raised on every rank by the caller
                problem = str(exc) if isinstance(exc, ValueError) else (
                    f"layers {ranges[s].start}-{ranges[s].stop - 1}: their tensors could not be "
                    f"made on {devices[rank]} ({type(exc).__name__}: {exc})")
                continue
            part = nn.Sequential(*(layers[i] for i in ranges[s])).to(devices[rank])
            held[s] = Stage(s, part, devices[rank], chains, ranges[s])
        stages[rank] = held
    return stages, problem, fresh


def materialize(layers: Sequence[nn.Module], indices: Sequence[int], device: torch.device
                ) -> list[Fresh]:
    """Makes every meta tensor of ``layers[indices]`` a tensor on ``device``
    of the same shape, dtype and ``requires_grad``, in place
    (``torch.utils.swap_tensors``: the Parameter objects, their class and
    attributes stay the ones the model and the caller hold, and a tensor two
    layers share stays one). Floating and complex tensors are filled with
    NaN, the others left empty: ``unwritten`` finds those nothing has
    written since.

    Raises:
        ValueError: a tensor cannot be swapped in place (it has weak references).
        RuntimeError: as ``torch.full_like`` and ``torch.empty_like`` (out of memory).
    """
    fresh = []
    for i in indices:
        for prefix, module in layers[i].named_modules(remove_duplicate=False):
            for table in (module._parameters, module._buffers):
                for attr, t in table.items():
                    if t is None:
                        continue
                    name = f"{i}.{prefix + '.' if prefix else ''}{attr}"
                    # Made already (a tensor held in two places, each checked; or
                    # by an earlier Pipe, and not yet found written).
                    earlier = getattr(t, _MADE, None)
                    if earlier is not None:
                        fresh.append(Fresh(name, module, attr, *earlier))
                        continue
                    if not t.is_meta:
                        continue
                    nan = t.is_floating_point() or t.is_complex()
                    new = (torch.full_like(t, float("nan"), device=device) if nan
                           else torch.empty_like(t, device=device))
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    new.__class__ = type(t)  # swap_tensors swaps classes and attributes too
                    new.__dict__.update(t.__dict__)
                    try:
                        torch.utils.swap_tensors(t, new)
                    except RuntimeError as exc:
                        raise ValueError(f"layer {i} ({type(layers[i]).__name__}): its meta tensor "
                                         f"{name} cannot be made on {device} in place ({exc})"
                                         ) from exc
                    setattr(t, _MADE, (id(t), nan, t._version, t.data_ptr()))
                    fresh.append(Fresh(name, module, attr, *getattr(t, _MADE)))
    return fresh


def unwritten(fresh: Sequence[Fresh]) -> list[str]:
    """The names of the ``fresh`` tensors nothing has written: still in
    their module and, where ``materialize`` filled them with NaN, holding a
    NaN anywhere (so no optimizer step at zero learning rate, dtype cast
    or other rewrite of the same memory counts as a load); the others still
    with the version and memory they were made with (an in-place write
    moves the version, a load with ``assign=True`` puts another tensor
    there; a write through ``.data`` is not seen). One host sync per call,
    made once, before the first step."""
    out: list[str] = []
    nans: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}  # per device: one sync each
    for f in fresh:
        now = _still_there(f)
        if now is None:
            continue  # replaced: what is there now is the caller's
        if f.nan:
            try:
                nans.setdefault(now.device, []).append((f.name, now.isnan().any()))
                continue
            except RuntimeError:  # no isnan for this dtype here: the version tells
                pass
        if now._version == f.version and now.data_ptr() == f.data_ptr:
            out.append(f.name)
    for flags in nans.values():
        found = torch.stack([flag for _, flag in flags]).tolist()
        out += [name for (name, _), bad in zip(flags, found) if bad]
    return out


def written(fresh: Sequence[Fresh]) -> None:
    """Drops the mark ``materialize`` left on the ``fresh`` tensors, once
    ``unwritten`` found none: later Pipes need not check them again."""
    for f in fresh:
        now = _still_there(f)
        if now is not None and hasattr(now, _MADE):
            delattr(now, _MADE)


def _still_there(f: Fresh) -> torch.Tensor | None:
    """The tensor ``f`` names if its module still holds it, else None."""
    now = f.module._parameters.get(f.attr, f.module._buffers.get(f.attr))
    return now if now is not None and id(now) == f.tensor_id else None


def changed_layer(now: Sequence[nn.Module], built: Sequence[nn.Module]) -> str | None:
    """The stages hold the layers the model had when they were built: a
    layer replaced, added or removed since would silently not train. What
    changed, or None."""
    if tuple(now) == tuple(built):
        return None
    changed = next((i for i, (a, b) in enumerate(zip(now, built)) if a is not b),
                   min(len(now), len(built)))
    return (f"the model's layers changed after the Pipe was built (layer {changed} of "
            f"{len(built)}, now {len(now)} layers): build a new Pipe over the model")


def free_remote(layers: Sequence[nn.Module], ranges: Sequence[range], mine: Sequence[int]) -> None:
    """The layers of stages not in ``mine`` keep their parameters' and
    buffers' shapes and dtypes on the meta device, and their data is freed
    (once nothing else holds it). A tensor that a stage in ``mine`` uses too
    (a tied parameter, a module used twice) stays."""
    keep = {id(t) for s in mine for i in ranges[s]
            for t in itertools.chain(layers[i].parameters(), layers[i].buffers())}
    for s, layer_range in enumerate(ranges):
        if s not in mine:
            for i in layer_range:
                to_meta(layers[i], keep)


def meta_problem(layers: list[nn.Module], indices: Sequence[int], released_only: bool = False
                 ) -> str | None:
    """What is wrong when one of ``layers[indices]`` holds meta tensors (no
    data to compute with), or None. ``released_only``: only tensors
    ``free_remote`` released count (a model built on meta is materialized)."""
    for i in indices:
        tensors = itertools.chain(layers[i].parameters(), layers[i].buffers())
        if any(getattr(t, _RELEASED, False) for t in tensors if t.is_meta):
            return (f"layer {i} ({type(layers[i]).__name__}) has tensors on the meta device (no "
                    "data), released by an earlier Pipe with free_remote=True; build the model "
                    "again (or load its values into a model built on the meta device) before "
                    "this Pipe")
        if not released_only and any(t.is_meta for t in itertools.chain(
                layers[i].parameters(), layers[i].buffers())):
            return (f"layer {i} ({type(layers[i]).__name__}) is on the meta device (no data): "
                    "balance='auto' and fastpipe.plan time every layer on real data; give the "
                    "balance (layers per stage) for a model built on the meta device")
    return None


def to_meta(module: nn.Module, keep: set[int] = frozenset()) -> None:
    """Swaps every parameter and buffer of ``module`` for a meta tensor of
    the same shape, dtype and ``requires_grad`` (a tensor's ``.data`` cannot
    change to the meta device, so the module's entries are replaced; a
    parameter used twice inside ``module`` stays one parameter), except
    those whose ``id`` is in ``keep``."""
    swapped: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table, make in ((sub._parameters, _meta_parameter), (sub._buffers, _meta_tensor)):
            for name, t in table.items():
                if t is not None and not t.is_meta and id(t) not in keep:
                    if id(t) not in swapped:
                        swapped[id(t)] = make(t)
                    table[name] = swapped[id(t)]


def _meta_tensor(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t, device="meta")
    setattr(out, _RELEASED, True)
    return out


def _meta_parameter(p: nn.Parameter) -> nn.Parameter:
    out = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    setattr(out, _RELEASED, True)
    return out
