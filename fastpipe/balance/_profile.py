"""Measuring a model layer by layer: times of F, B, I, W and bytes per microbatch.

Each layer runs on the output of the one before, on one microbatch, with
the same backward functions the executor uses (full B, input-only I,
weight-only W), so the costs the planner simulates are the executor's.
Times are medians over ``repeats`` after ``warmup`` runs. Memory per layer:
parameter bytes and the bytes autograd saves for backward (parameters
excluded), counted with saved-tensor hooks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from fastpipe import _microbatch as mbatch
from fastpipe.runtime._backward import backward_full, backward_input, backward_weight
from fastpipe.runtime.memory import SavedBytes


@dataclass(frozen=True)
class LayerProfile:
    """One layer on one microbatch: seconds and bytes."""

    forward: float
    backward: float
    input_backward: float
    weight_backward: float
    param_bytes: int
    activation_bytes: int  # saved for backward, per microbatch
    output_bytes: int  # what crosses a boundary placed after this layer


@dataclass(frozen=True)
class Profile:
    """Per-layer costs at ``rows`` rows per microbatch (see ``scaled``)."""

    layers: tuple[LayerProfile, ...]
    rows: int
    device: str
    # Per layer (a, b) fits of time = a + b * rows, when profiled at two sizes.
    fits: tuple[dict, ...] = field(default=(), compare=False)

    def scaled(self, rows: int) -> Profile:
        """Costs at another microbatch size: times from the two-size fit (or
        proportional when there is none), bytes proportional to rows."""
        factor = rows / self.rows
        layers = []
        for i, layer in enumerate(self.layers):
            fit = self.fits[i] if self.fits else None

            def time_of(name: str, value: float) -> float:
                if fit is None:
                    return value * factor
                a, b = fit[name]
                return max(a + b * rows, 0.0)

            layers.append(replace(
                layer,
                forward=time_of("forward", layer.forward),
                backward=time_of("backward", layer.backward),
                input_backward=time_of("input_backward", layer.input_backward),
                weight_backward=time_of("weight_backward", layer.weight_backward),
                activation_bytes=int(layer.activation_bytes * factor),
                output_bytes=int(layer.output_bytes * factor),
            ))
        return Profile(tuple(layers), rows, self.device, self.fits)


def _median(fn: Callable[[], float], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(repeats))


def _leaves(value, device) -> tuple[list[torch.Tensor], object]:
    tensors, spec = mbatch.flatten(value)
    out = []
    for t in tensors:
        t = t.detach().to(device)
        out.append(t.requires_grad_(t.is_floating_point() or t.is_complex()))
    return out, spec


def _layer(layer: nn.Module, value, device, warmup: int, repeats: int) -> tuple[LayerProfile, object]:
    params = [p for p in layer.parameters() if p.requires_grad]
    saved = SavedBytes(layer.parameters())

    def run():
        leaves, spec = _leaves(value, device)
        with saved.counting():
            out = layer(mbatch.unflatten(leaves, spec))
        tensors, _ = mbatch.flatten(out)
        roots = [get_gradient_edge(t) for t in tensors if mbatch.needs_grad(t)]
        grads = [torch.ones_like(t) for t in tensors if mbatch.needs_grad(t)]
        return leaves, out, roots, grads

    def timed_forward() -> float:
        leaves, spec = _leaves(value, device)
        t0 = time.perf_counter()
        layer(mbatch.unflatten(leaves, spec))
        return time.perf_counter() - t0

    def timed_backward() -> float:
        _, _, roots, grads = run()
        t0 = time.perf_counter()
        backward_full(roots, grads)
        return time.perf_counter() - t0

    def timed_split() -> tuple[float, float]:
        leaves, _, roots, grads = run()
        t0 = time.perf_counter()
        _, work = backward_input(roots, grads, leaves, params)
        t1 = time.perf_counter()
        backward_weight(work)
        return t1 - t0, time.perf_counter() - t1

    forward = _median(timed_forward, warmup, repeats)
    backward = _median(timed_backward, warmup, repeats)
    splits = [timed_split() for _ in range(warmup + repeats)][warmup:]
    saved.total = 0
    _, out, _, _ = run()
    activation = saved.total
    for p in params:
        p.grad = None  # profiling must not leave gradients behind
    tensors, _ = mbatch.flatten(out)
    profile = LayerProfile(
        forward=forward,
        backward=backward,
        input_backward=statistics.median(s[0] for s in splits),
        weight_backward=statistics.median(s[1] for s in splits),
        param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
        activation_bytes=activation,
        output_bytes=sum(t.numel() * t.element_size() for t in tensors),
    )
    detached = tuple(t.detach() for t in tensors)
    return profile, mbatch.unflatten(list(detached), mbatch.flatten(out)[1])


def _profile_at(model: nn.Sequential, micro, device, warmup: int, repeats: int) -> list[LayerProfile]:
    layers, value = [], micro
    for layer in model:
        prof, value = _layer(layer, value, device, warmup, repeats)
        layers.append(prof)
    return layers


def profile(
    model: nn.Sequential,
    sample,
    device: str | torch.device = "cpu",
    chunks: int = 1,
    repeats: int = 5,
    warmup: int = 2,
    fit_rows: int | None = None,
) -> Profile:
    """Profiles every layer of ``model`` on one microbatch of ``sample``.

    Args:
        model: the ``nn.Sequential`` (its layers are moved to ``device``).
        sample: an input batch (tensor or tuple of tensors), split into ``chunks``.
        device: where to run.
        chunks: microbatches the batch is split into; the first is profiled.
        repeats, warmup: median over ``repeats`` timed runs after ``warmup``.
        fit_rows: also profile at this microbatch size and fit
            ``time = a + b * rows`` per layer, so ``Profile.scaled`` follows
            the fixed per-call cost of small microbatches.

    Returns:
        A ``Profile``.

    Example:
        >>> prof = profile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(16, 8), chunks=4)
        >>> len(prof.layers), prof.rows
        (2, 4)
    """
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise TypeError(f"profile needs a non-empty nn.Sequential, got {type(model).__name__}")
    device = torch.device(device)
    model.to(device)
    micro = mbatch.split(sample, chunks)[0]
    rows = mbatch.batch_size(micro)
    layers = _profile_at(model, micro, device, warmup, repeats)
    fits: tuple[dict, ...] = ()
    if fit_rows is not None and fit_rows != rows:
        other_micro = _rows_of(sample, fit_rows)
        other = _profile_at(model, other_micro, device, warmup, repeats)
        fits = tuple(_fit(a, rows, b, fit_rows) for a, b in zip(layers, other))
    return Profile(tuple(layers), rows, str(device), fits)


def _rows_of(sample, rows: int):
    if isinstance(sample, tuple):
        return tuple(t[:rows] for t in sample)
    return sample[:rows]


def _fit(at_a: LayerProfile, rows_a: int, at_b: LayerProfile, rows_b: int) -> dict:
    out = {}
    for name in ("forward", "backward", "input_backward", "weight_backward"):
        ta, tb = getattr(at_a, name), getattr(at_b, name)
        slope = (tb - ta) / (rows_b - rows_a)
        out[name] = (ta - slope * rows_a, slope)
    return out
