"""Measuring a model layer by layer: times of F, B, I and W and bytes per microbatch.

Each layer runs on the output of the one before, on one microbatch, with
the same backward functions the executor uses (full B, input-only I,
weight-only W), so the costs the planner simulates are the executor's.
Layers are timed in runs of ``window`` consecutive layers, the way a
pipeline stage meets them (forward through the run, then backward back
through it): one layer timed over and over stays in cache, and a stage's
time comes out short (``docs/design/memory.md``, "How the planner walks
memory"). Times are medians over ``repeats`` after ``warmup`` runs. Memory
per layer: parameter bytes, the bytes autograd saves for backward
(parameters excluded, a tensor saved twice once), counted with saved-tensor
hooks on the layer before's output as a stage runs them, and the bytes a
split schedule's W reads from I on (what the layer's weight rules kept,
and the output gradients I left them). Given the step's loss, the last
layer's figures include it, as the last stage's F and I do. Profiling
leaves the model's buffers (a BatchNorm's running statistics) and the random
generators as it found them: a Pipe that balances itself trains the model
the unsplit loop would.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from fastpipe import _microbatch as mbatch
from fastpipe.runtime import deferred
from fastpipe.runtime._backward import backward_full
from fastpipe.runtime.memory import SavedBytes

__all__ = ["LayerProfile", "Profile", "profile"]


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
    weight_bytes: int = 0  # what W reads, held from I to W (a split schedule)
    # Of activation_bytes, what the layer before saved too (its output, this
    # one's input): one tensor, counted once where both are in one stage.
    shared_bytes: int = 0
    # A stage's W waits to be gathered with later microbatches' while the
    # rows waiting stay under the limit (``deferred.WeightQueue``): this
    # layer's rows per microbatch and limit, 0 where its W runs at once.
    gather_rows: int = 0
    gather_limit: int = 0


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
                weight_bytes=int(layer.weight_bytes * factor),
                shared_bytes=int(layer.shared_bytes * factor),
                gather_rows=int(layer.gather_rows * factor),
            ))
        return Profile(tuple(layers), rows, self.device, self.fits)


def _leaves(value, device, first: bool = False) -> tuple[list[torch.Tensor], object]:
    """Fresh leaves for one layer's input. Between stages every floating
    tensor wants a gradient; the model's own input only when the user's
    does, as in the executor (so the first layer's I is nearly free and its
    W does the whole backward)."""
    tensors, spec = mbatch.flatten(value)
    out = []
    for t in tensors:
        wants = t.requires_grad if first else t.is_floating_point() or t.is_complex()
        out.append(t.detach().to(device).requires_grad_(wants))
    return out, spec


def _detached(out):
    tensors, spec = mbatch.flatten(out)
    return mbatch.unflatten([t.detach() for t in tensors], spec)


class _Timed:
    """One layer and every timed sample of its F, B, I and W."""

    def __init__(self, layer: nn.Module, first: bool, loss=None):
        # ``loss``: the last layer's, ``(output) -> scalar``: its F, B and I
        # then take in the loss as the last stage's do.
        self.layer, self.first, self.loss = layer, first, loss
        self.device = "cpu"  # the device of the last forward (set there)
        self.weight_bytes = 0  # what its W reads after I (set by the last window)
        self.gathering = (0, 0)  # WeightQueue.gathering of its W (likewise)
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self.samples: dict[str, list[float]] = {"forward": [], "backward": [],
                                                "input_backward": [], "weight_backward": []}

    def forward(self, value, device, record: bool, pending: deferred.Pending | None = None):
        """F on fresh leaves; returns (leaves, roots, grads) for B, I and W.
        With ``pending``, the layers defer their weight gradients into it
        (as a split schedule's forward runs them)."""
        leaves, spec = _leaves(value, device, self.first)
        _sync(device)
        t0 = time.perf_counter()
        with deferred.collecting(pending) if pending is not None else contextlib.nullcontext():
            out = self.layer(mbatch.unflatten(leaves, spec))
            if self.loss is not None:
                out = self.loss(out)
        if record:
            _sync(device)
            self.samples["forward"].append(time.perf_counter() - t0)
        self.device = device
        tensors, _ = mbatch.flatten(out)
        roots = [get_gradient_edge(t) for t in tensors if mbatch.needs_grad(t)]
        grads = [torch.ones_like(t) for t in tensors if mbatch.needs_grad(t)]
        return leaves, roots, grads

    def timed(self, name: str, fn, record: bool):
        _sync(self.device)
        t0 = time.perf_counter()
        result = fn()
        if record:
            _sync(self.device)
            self.samples[name].append(time.perf_counter() - t0)
        return result


def _sync(device) -> None:
    """On a GPU the host only queues kernels: wait for them, so a sample is
    the layer's device time, not its launch time."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _run_window(timed: list[_Timed], inputs: list, device, record: bool) -> None:
    """One pass over a run of consecutive layers, as a pipeline stage meets
    them: F through the run then B back through it, then F again, I back
    through the run and W after all the I's (zero-bubble order)."""
    graphs = [t.forward(v, device, record) for t, v in zip(timed, inputs)]
    for t, (_, roots, grads) in zip(reversed(timed), reversed(graphs)):
        t.timed("backward", lambda: backward_full(roots, grads), record)
    installed = [deferred.install(t.layer) for t in timed]
    try:
        pendings = [deferred.Pending() for _ in timed]
        graphs = [t.forward(v, device, False, p) for t, v, p in zip(timed, inputs, pendings)]
        for t, (leaves, roots, grads), p in zip(reversed(timed), reversed(graphs), reversed(pendings)):
            t.timed("input_backward",
                    lambda: deferred.backward_input(roots, grads, leaves, t.params, p), record)
            t.weight_bytes, t.gathering = p.nbytes, deferred.WeightQueue.gathering(p)
        for t, p in zip(reversed(timed), reversed(pendings)):
            t.timed("weight_backward", lambda: deferred.run_weight(p.entries, calls=p.calls), record)
    finally:
        for layers in installed:
            deferred.uninstall(layers)


def _profile_at(model: nn.Sequential, micro, device, warmup: int, repeats: int,
                window: int, loss=None) -> list[LayerProfile]:
    # The input of every layer (and its output's size), from one plain pass.
    inputs, value = [], micro
    for layer in model:
        inputs.append(value)
        with torch.no_grad():
            value = _detached(layer(_detached(value)))
    last = len(model) - 1
    timed = [_Timed(layer, i == 0, loss if i == last else None) for i, layer in enumerate(model)]
    for start in range(0, len(timed), window):
        part = slice(start, start + window)
        for i in range(warmup + repeats):
            _run_window(timed[part], inputs[part], device, record=i >= warmup)
    # Bytes saved: each layer on the layer before's output (detached: the
    # same memory, its own graph), as a stage runs them, so what both save
    # (one's output, the other's input) is seen once (``shared_bytes``).
    # Two layers' graphs are alive at a time: the one before keeps its
    # addresses from being handed out again while they are compared.
    layers, before, previous = [], set(), None
    for t, value in zip(timed, inputs):
        saved = SavedBytes(t.layer.parameters())
        leaves, spec = _leaves(value if previous is None else previous, device, t.first)
        with saved.counting():
            out = t.layer(mbatch.unflatten(leaves, spec))
            if t.loss is not None:  # what the loss saved, the last stage's too
                t.loss(out)
        shared = sum(n for _, n in saved.seen & before)
        before, previous = saved.seen, out
        for p in t.params:
            p.grad = None  # profiling must not leave gradients behind
        tensors, _ = mbatch.flatten(out)
        layers.append(LayerProfile(
            **{name: statistics.median(v) for name, v in t.samples.items()},
            param_bytes=sum(p.numel() * p.element_size() for p in t.layer.parameters()),
            activation_bytes=saved.total,
            output_bytes=sum(x.numel() * x.element_size() for x in tensors),
            weight_bytes=t.weight_bytes,
            shared_bytes=shared,
            gather_rows=t.gathering[0],
            gather_limit=t.gathering[1],
        ))
    return layers


def profile(
    model: nn.Sequential,
    sample,
    device: str | torch.device = "cpu",
    chunks: int = 1,
    repeats: int = 5,
    warmup: int = 2,
    fit_rows: int | None = None,
    window: int | None = None,
    loss_fn=None,
    target=None,
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
        window: layers timed together as one run (default: all of them);
            the planner passes about the number of layers a rank holds.
        loss_fn, target: the step's ``loss_fn(output, target)`` and target
            batch (split as ``sample``): the last layer's times and bytes
            then include the loss, as the last stage runs it (a vocabulary
            head's cross-entropy saves its log-softmax, the largest tensor
            of a language model's step). Both or neither.

    Returns:
        A ``Profile``.

    Example:
        >>> prof = profile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(16, 8), chunks=4)
        >>> len(prof.layers), prof.rows
        (2, 4)
    """
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise TypeError(f"profile needs a non-empty nn.Sequential, got {type(model).__name__}")
    from fastpipe._stages import meta_problem

    problem = meta_problem(list(model), range(len(model)))
    if problem is not None:
        raise ValueError(problem)
    device = torch.device(device)
    model.to(device)
    window = len(model) if window is None else window
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"profile needs repeats >= 1 and warmup >= 0, got {repeats!r} and {warmup!r}")
    if (loss_fn is None) != (target is None):
        raise ValueError("profile takes loss_fn and target together, or neither")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    micro = mbatch.split(sample, chunks)[0]
    rows = mbatch.batch_size(micro)
    with _unchanged(model, device):
        layers = _profile_at(model, micro, device, warmup, repeats, window,
                             _loss_of(loss_fn, target, chunks, device))
        fits: tuple[dict, ...] = ()
        if fit_rows is not None and fit_rows != rows:
            other = _profile_at(model, _rows_of(sample, fit_rows), device, warmup, repeats, window,
                                _loss_of(loss_fn, target, chunks, device, fit_rows))
            fits = tuple(_fit(a, rows, b, fit_rows) for a, b in zip(layers, other))
    return Profile(tuple(layers), rows, str(device), fits)


@contextlib.contextmanager
def _unchanged(model: nn.Module, device: torch.device):
    """Runs the block, then puts back ``model``'s buffers (in place) and the
    CPU's and ``device``'s random generators as they were before it."""
    buffers = [(b, b.clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, before in buffers:
                    b.copy_(before)


def _loss_of(loss_fn, target, chunks: int, device, rows: int | None = None):
    """``(output) -> loss_fn(output, target)`` on the profiled microbatch's
    target (its first ``rows`` rows, where given), on ``device``; None
    without a loss."""
    if loss_fn is None:
        return None
    micro = _rows_of(target, rows) if rows is not None else mbatch.split(target, chunks)[0]
    micro = tuple(t.to(device) for t in micro) if isinstance(micro, tuple) else micro.to(device)
    return lambda out: loss_fn(out, micro)


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
