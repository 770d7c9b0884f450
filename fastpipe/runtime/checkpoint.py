"""Stage checkpointing: forget a stage's activations in forward, recompute them in backward.

A checkpointed microbatch runs its stage forward with every tensor autograd
would save dropped (a ``saved_tensors_hooks`` pair that keeps nothing), so
the graph and the ``requires_grad`` flags are exactly those of a normal
forward but hold no activation memory. Its backward (B or I) first runs the
stage forward again from the same inputs, under the random state the first
forward started with, and then backpropagates through that fresh graph:

    F (checkpointed):  x ──► stage(x) ──► y   (nothing saved; RNG state kept)
    B / I:             restore RNG ──► stage(x) ──► y' ──► backward(y', dy)

A recomputation leaves the running statistics of torch's norm layers as the
first forward left them (``norm_layers``), so a checkpointed BatchNorm counts
each microbatch once, as the unsplit model does.

The modes follow torchgpipe: ``"always"`` checkpoints every microbatch,
``"except_last"`` all but the last (whose backward comes right after its
forward, so recomputing it saves nothing), ``"never"`` none.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "MODES", "NO_RANDOM", "RngState", "check_mode", "checkpointed", "forgetful", "guarded",
    "is_recomputing", "norm_layers", "recompute", "seeded", "stage_seed", "stochastic",
]

MODES = ("never", "except_last", "always")

_state = threading.local()


def is_recomputing() -> bool:
    """True while the current thread runs a stage's forward again for its backward.

    A layer with side effects (a counter, a running statistic, a cache) can
    skip them during the recomputation, which would otherwise repeat them::

        def forward(self, x):
            if not fastpipe.is_recomputing():
                self.calls += 1
            return self.body(x)
    """
    return getattr(_state, "recomputing", False)


@contextmanager
def _recomputing() -> Iterator[None]:
    previous = is_recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous


def check_mode(mode: object) -> str:
    """Returns ``mode`` if it is one of ``MODES``.

    Raises:
        ValueError: any other value.
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"checkpoint must be one of {list(MODES)}, got {mode!r}")
    return mode


def checkpointed(mode: str, microbatch: int, microbatches: int) -> bool:
    """Whether ``microbatch`` of a stage is checkpointed under ``mode``."""
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch != microbatches - 1
    return False


def stochastic(module: nn.Module, training_only: bool = False) -> bool:
    """True when ``module`` holds a layer known to draw random numbers in
    training: torch's dropouts and RReLU, and any layer whose class (or
    instance) sets ``draws_random = True`` (fastpipe's ``SeededDropout``
    does; a custom random layer can too). ``training_only``: only layers in
    training mode count."""
    kinds = (nn.modules.dropout._DropoutNd, nn.RReLU)
    return any((isinstance(m, kinds) or getattr(m, "draws_random", False) is True)
               and (m.training or not training_only) for m in module.modules())


def norm_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module`` whose training forward updates running
    statistics in place: torch's BatchNorm and InstanceNorm kinds (and their
    subclasses, ``SyncBatchNorm`` among them) that track them."""
    return [m for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]


_STATS = ("running_mean", "running_var", "num_batches_tracked")


@contextmanager
def _stats_kept(layers: list[nn.Module]) -> Iterator[None]:
    """Runs the block with copies of the running statistics of ``layers`` in
    training mode, then puts the originals back: a recomputed forward would
    otherwise count its microbatch twice. Copies, not a restore in place:
    the recomputed graph saves the statistics, and writing into them again
    would fail its backward's version check."""
    kept = [(m, name, getattr(m, name)) for m in layers if m.training for name in _STATS
            if getattr(m, name, None) is not None]
    for m, name, t in kept:
        setattr(m, name, t.clone())
    try:
        yield
    finally:
        for m, name, t in kept:
            setattr(m, name, t)


class _NoRandom:
    """The random state of a checkpointed stage that draws none: nothing to
    replay, and nothing to touch on the generator other ranks' threads
    share (``RngState.replay`` sets it, which would move their draws)."""

    @staticmethod
    def replay():
        return nullcontext()


NO_RANDOM = _NoRandom()


@dataclass
class RngState:
    """The CPU generator's state and, for a CUDA stage, its device's."""

    cpu: torch.Tensor
    device: torch.device
    cuda: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), device, cuda)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Runs the block from this state; the generators continue afterwards
        as if the block had not run."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


@contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Runs the block with the generators a stage on ``device`` draws from
    (the CPU's, and its GPU's for a CUDA stage) seeded with ``seed``; they
    continue afterwards as if the block had not run. Local mode seeds each
    stochastic forward by (step, stage, microbatch) this way, under the
    ranks' shared lock, so dropout masks do not depend on which rank's
    thread drew first."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        yield


def stage_seed(base: int, stage: int, microbatch: int) -> int:
    """A seed for one (stage, microbatch) of a step whose draw was ``base``."""
    return ((base * 1_000_003 + stage) * 1_000_003 + microbatch) % (1 << 63)


def _drop(_tensor: torch.Tensor) -> None:
    return None


def _never_unpacked(_packed: None) -> torch.Tensor:
    raise AssertionError("a checkpointed forward's graph was used for backward")


def forgetful():
    """Context in which autograd builds its graph but saves no tensor."""
    return torch.autograd.graph.saved_tensors_hooks(_drop, _never_unpacked)


@contextmanager
def recompute(rng: RngState, lock: threading.Lock | None,
              norms: list[nn.Module] = ()) -> Iterator[None]:
    """The block re-runs a checkpointed forward: same random state, flagged,
    the running statistics of ``norms`` (``norm_layers``) left as they were."""
    with _maybe(lock), rng.replay(), _recomputing(), torch.enable_grad(), \
            _stats_kept(norms) if norms else nullcontext():
        yield


@contextmanager
def _maybe(lock: threading.Lock | None) -> Iterator[None]:
    if lock is None:
        yield
        return
    with lock:
        yield


def guarded(lock: threading.Lock | None):
    """Holds ``lock`` (if any) around a forward that draws random numbers.

    In local mode every rank is a thread sharing the CPU generator; a
    checkpointed forward is replayed exactly only if no other thread draws
    from it in between, so stochastic forwards take turns.
    """
    return _maybe(lock)
