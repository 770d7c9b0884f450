"""A Pipe's stages: which layers each holds, on which device, and what a
distributed rank keeps of the layers other ranks run (``free_remote``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from fastpipe.runtime.executor import Stage

__all__ = ["build_stages", "changed_layer", "free_remote", "meta_problem", "to_meta"]


def build_stages(layers: Sequence[nn.Module], ranges: Sequence[range], stage_to_rank: Sequence[int],
                 ranks: Sequence[int], devices: Sequence[torch.device], chains: str = "on"
                 ) -> tuple[dict[int, dict[int, Stage]], str | None]:
    """``({rank: {stage: Stage}}, problem)`` for the ranks ``ranks`` (this
    process's), each stage's layers moved to its rank's device. A layer
    holding meta tensors (no data: released by an earlier ``free_remote``
    Pipe, or never materialized) is not moved; ``problem`` says which, for
    the caller to raise on every rank. ``chains``: as ``Stage.chains``."""
    problem = None
    stages: dict[int, dict[int, Stage]] = {}
    for rank in ranks:
        held = {}
        for s, owner in enumerate(stage_to_rank):
            if owner != rank:
                continue
            found = meta_problem(layers, ranges[s])
            if found is not None:
                problem = found
                continue
            part = nn.Sequential(*(layers[i] for i in ranges[s])).to(devices[rank])
            held[s] = Stage(s, part, devices[rank], chains, ranges[s])
        stages[rank] = held
    return stages, problem


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


def meta_problem(layers: list[nn.Module], indices: Sequence[int]) -> str | None:
    """What is wrong when one of ``layers[indices]`` holds meta tensors (no
    data to compute with), or None."""
    for i in indices:
        if any(t.is_meta for t in itertools.chain(layers[i].parameters(), layers[i].buffers())):
            return (f"layer {i} ({type(layers[i]).__name__}) has tensors on the meta device (no "
                    "data), e.g. released by an earlier Pipe with free_remote=True; build the "
                    "model again (or materialize it) before this Pipe")
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
    return torch.empty_like(t, device="meta")


def _meta_parameter(p: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(_meta_tensor(p), requires_grad=p.requires_grad)
