"""Deferred weight gradients: the I/W split of zero-bubble schedules, for any stage.

A zero-bubble schedule splits a stage's backward in two: ``I`` produces the
gradient the previous stage waits for, ``W`` the weight gradients, later,
in time the schedule would otherwise leave idle. Here the split is made by
the layers themselves, as in the zero-bubble paper's implementation and
Megatron's ``delay_wgrad_compute``: while a stage runs forward under a
split schedule, every layer with a rule (``nn.Linear``, ``nn.LayerNorm``,
``nn.RMSNorm``, ``nn.Embedding``, Hugging Face's ``Conv1D`` and Llama-style
RMSNorm, and what users register) calls its usual
functional op with its parameters *detached*, so autograd's node for it
computes the input gradient only, and appends to the microbatch's
:class:`Pending` what the rule kept for W and the graph edge of its output.
``I`` is one ordinary engine call over the stage that also returns the
gradient at each of those edges (extra outputs: no Python runs inside the
engine); ``W`` runs the list:

    F:  x ─► linear(x, W.detach()) ─► ... ─► out        ops as usual, no
                 └─ entry: x, out's edge                weight edges
    I:  g ─► dx ─► ... ─► dx                            one engine call; each
              └─ entry.g = gradient at out's edge       entry gets its g
    W:  for each entry: W.grad += gᵀx, ...              no graph, no engine

No graph is kept for W and no second walk of it happens; the per-layer
Python is a small ``forward`` wrapper, not an ``autograd.Function``. What W
keeps is what autograd would have saved for the weight gradient (the input,
in the dtype autocast computes in), booked by the executor. A parameter
whose layer has no rule (or that a hook watches) gets its gradient in ``I``
from autograd, as in a plain backward: correct, just not deferred.

Rounding: the forward and the input gradient are autograd's own ops; the
weight gradients are what autograd's formulas compute, in the dtype it
computes them in, added to the float ``.grad``. By default a Linear's is
accumulated with one ``addmm_`` into an existing ``.grad`` of its dtype,
and Linears of several microbatches may be gathered into one GEMM
(:class:`WeightQueue`): the sum over microbatches then happens inside the
GEMM, as for the unsplit batch. ``run_weight(fuse=False)`` keeps
autograd's rounding exactly (``mm`` per microbatch, then ``add_``).

What keeps the plain backward (read at a layer's first call of each step,
so nothing is wrong, only undeferred): grad mode off, a call with extra
arguments, a parameter with tensor or post-accumulate hooks or that is no
leaf (parametrized), an ``nn.Embedding`` with ``max_norm`` or sparse
gradients, layers inside a module compiled with ``torch.compile`` (Dynamo
traces the class ``forward``, not the wrapper set on the instance, and could
not capture its appends to a Python list), and a module whose ``forward``
the user set on the instance.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from fastpipe._ext import native_chain
from fastpipe.runtime._backward import Root, backward_full, filled, run_backward
from fastpipe.runtime.eager_checks import param_hooked
from fastpipe.runtime.memory import span

__all__ = [
    "EmbeddingRule", "Entry", "LayerNormRule", "LinearRule", "Pending", "RMSNormRule", "WeightQueue",
    "WeightRule", "accumulate", "backward_input", "collecting", "install", "linear_entry", "linear_work",
    "register_weight_rule", "rule_for", "run_weight", "uninstall",
]



class WeightRule:
    """How one layer type defers its weight gradients.

    Subclass it and :func:`register_weight_rule` the layer type.

    ``params(module)``: the parameters (None for an absent one) in a fixed
    order; ``weight_grads`` answers in that order.
    ``forward(module, x, detached)``: the layer's output computed from
    ``detached`` (its parameters, detached, in ``params`` order) with the
    same ops the module runs, so autograd records only the input path,
    under whatever autocast region is active; returns ``(output, kept,
    meta)``: ``kept`` a tuple of the tensors W needs (detached; never the
    output itself), ``meta`` anything else.
    ``weight_grads(kept, meta, targets, g)``: a fresh gradient per
    parameter from the output gradient ``g``, None where ``targets`` has
    None (that one needs none). Runs without autograd recording or autocast.
    ``rows(kept, meta)``/``gather(entries)``: rules whose weight gradient is
    a sum over rows (a Linear) say how many rows a call has, and sum the
    gradients of one or several calls in one go, possibly into ``.grad``
    in place (what W runs unless autograd's exact rounding is asked for);
    other rules leave ``rows`` None.
    """

    def params(self, module: nn.Module) -> tuple[torch.Tensor | None, ...]:
        raise NotImplementedError

    def accepts(self, module: nn.Module) -> bool:
        """False where this module must keep the plain backward."""
        return True

    def forward(self, module: nn.Module, x: torch.Tensor, detached: Sequence[torch.Tensor | None]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], Any]:
        raise NotImplementedError

    def weight_grads(self, kept, meta, targets, g: torch.Tensor
                     ) -> tuple[torch.Tensor | None, ...]:
        raise NotImplementedError

    def rows(self, kept, meta) -> int | None:
        return None

    def gather(self, entries: list[Entry]) -> tuple[torch.Tensor | None, ...]:
        raise NotImplementedError

    def native(self, targets, meta, chain: ModuleType):
        """The layer as a ``fastpipe._chain.WeightLayer`` (the built-in rules'
        W in C++; made once per layer and step), or None: ``weight_grads`` /
        ``gather`` run."""
        return None

    # Built-in rules only: ``_fast(module) -> (kind, parameter names,
    # shape or ints, eps)``, what fastpipe._chain.DeferringForward needs to
    # run this rule's forward in C++; None: calls stay in Python.
    _fast = None


# Each registered type with its rule and its class ``forward`` then: a
# forward patched on the class since (a test, a profiler, a quantization
# library) is what must run, so the type no longer defers.
_RULES: dict[type, tuple[WeightRule, Callable | None]] = {}


def register_weight_rule(layer_type: type, rule: WeightRule) -> None:
    """Defers the weight gradients of layers of ``layer_type`` with ``rule``.

    Args:
        layer_type: an ``nn.Module`` subclass; its subclasses are covered
            where they inherit its ``forward`` unchanged.
        rule: a :class:`WeightRule` instance.

    Raises:
        TypeError: ``layer_type`` is not an ``nn.Module`` subclass or
            ``rule`` not a ``WeightRule``.
    """
    if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
        raise TypeError(f"layer_type must be an nn.Module subclass, got {layer_type!r}")
    if not isinstance(rule, WeightRule):
        raise TypeError(f"rule must be a fastpipe WeightRule, got {type(rule).__name__}")
    _RULES[layer_type] = rule, getattr(layer_type, "forward", None)
    _RECOGNISED.clear()


# Layers of libraries fastpipe does not import (Hugging Face's Conv1D, the
# Llama family's RMSNorm) are recognised by their ``forward``'s code: a class
# whose forward compiles to the same instructions, names and constants as a
# reference function computes what the reference does, whatever the class is
# called or wherever it lives, while any edit to it (another formula, a cast
# moved) makes it a stranger that keeps the plain backward.
_BY_CODE: dict[tuple, WeightRule] = {}
_RECOGNISED: dict[type, tuple[Callable | None, WeightRule | None]] = {}  # per class and forward


def _code_key(fn: Callable) -> tuple | None:
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return code.co_code, code.co_names, code.co_consts, code.co_argcount


def _register_by_code(reference: Callable, rule: WeightRule) -> None:
    """Defers layers whose class ``forward`` is ``reference``'s code with ``rule``."""
    _BY_CODE[_code_key(reference)] = rule
    _RECOGNISED.clear()


def rule_for(layer_type: type) -> WeightRule | None:
    """The rule deferring layers of ``layer_type``: registered for the type
    or a base class whose ``forward`` it inherits unchanged (a Linear
    subclass that only initialises differently, torch's
    ``NonDynamicallyQuantizableLinear``), that forward still the one
    registered; else recognised by the class ``forward``'s code. None: the
    plain backward."""
    forward = getattr(layer_type, "forward", None)
    known = _RECOGNISED.get(layer_type)
    if known is not None and known[0] is forward:
        return known[1]
    found = next((_RULES[base][0] for base in layer_type.__mro__
                  if base in _RULES and _RULES[base][1] is forward), None)
    if found is None:
        key = _code_key(forward)
        found = _BY_CODE.get(key) if key is not None else None
    _RECOGNISED[layer_type] = forward, found
    return found


# --- the entries W runs ---------------------------------------------------------


@dataclass(slots=True)
class Entry:
    """One layer call's weight-gradient work."""

    rule: WeightRule
    params: tuple[torch.Tensor | None, ...]
    saved: tuple[torch.Tensor, ...]
    meta: Any
    g: torch.Tensor | None  # the output's gradient, once I has run
    layer: int  # id of the module: its entries into the same parameters gather together
    native: Any = None  # the layer's fastpipe._chain.WeightLayer this step, or None


@dataclass
class Pending:
    """One microbatch's deferred layers: an entry per call, made by the
    forward; ``backward_input`` fills in each entry's output gradient. Calls
    made in C++ come as ``calls`` instead (``fastpipe._chain.Calls`` blocks,
    from the native deferring forwards or a chain stage's native I: W reads
    them in C++, and Python makes no entry per call)."""

    entries: list[Entry] = field(default_factory=list)
    calls: list = field(default_factory=list)
    # The graph edge of each entry's output, where I captures its gradient.
    edges: list[GradientEdge] = field(default_factory=list)
    # Memory (storage address ranges, ``borrowed_ranges``) the executor may
    # hand back after W (received buffers): an entry reading it is cloned
    # before it waits.
    borrowed: tuple[tuple[int, int], ...] = ()

    def __len__(self) -> int:
        """The deferred calls: entries and the blocks' calls."""
        return len(self.entries) + sum(map(len, self.calls))

    def spans(self) -> set[tuple[int, int]]:
        """``spans`` of this microbatch's entries and blocks."""
        return spans(self.entries, self.calls)

    @property
    def nbytes(self) -> int:
        """Bytes W holds, each tensor once (``spans``): after F, what the
        forward kept for it; after I, that and the output gradients (the
        executor books them until W)."""
        return sum(n for _, n in self.spans())


def spans(entries: Sequence[Entry], calls: Sequence = ()) -> set[tuple[int, int]]:
    """(address, bytes) of each distinct tensor W work reads: what the
    forward kept and, once I has run, the output gradients. A tensor two
    calls read (one input of three projections, one gradient of two
    outputs that meet in a sum) is one span."""
    out = {span(t) for e in entries for t in (*e.saved, e.g) if t is not None}
    for c in calls:
        out.update(c.spans)
    return out


def linear_work(module: nn.Linear) -> tuple:
    """What every W entry of ``module`` shares within a step: its rule, the
    parameters that want a gradient and the native WeightLayer (None where
    ``fastpipe._chain`` is not built). Made once per step by a chain stage."""
    targets = tuple(p if p is not None and p.requires_grad else None
                    for p in (module.weight, module.bias))
    rule, chain = _RULES[nn.Linear][0], native_chain()
    return rule, targets, rule.native(targets, None, chain) if chain is not None else None


def linear_entry(module: nn.Linear, g: torch.Tensor, x: torch.Tensor, work: tuple | None = None
                 ) -> Entry:
    """W's entry for a Linear whose output gradient ``g`` and (2-D) input
    ``x`` someone else kept: a chain stage's I (``fastpipe.runtime.chain``).
    ``work``: ``linear_work(module)`` of this step, made once for all calls."""
    rule, targets, native = work if work is not None else linear_work(module)
    return Entry(rule, targets, (x,), None, g, id(module), native)


def backward_input(roots: Sequence[Root], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                   pending: Pending | None, keep_graph: bool = False
                   ) -> list[torch.Tensor | None]:
    """I: one engine call from ``roots`` that returns the gradients of
    ``inputs`` (None where one needs none), captures each deferred layer's
    output gradient into its entry, and accumulates into ``.grad`` whatever
    reached ``params`` through autograd (their layers did not defer, or a
    weight is also used outside its layer).

    Everything is asked of the engine as extra outputs, so nothing of
    fastpipe's runs inside it: on threads of one interpreter (local mode)
    a Python hook there would wait for the other ranks' GIL. ``pending``
    None (nothing deferred): a plain backward. ``keep_graph`` as in
    ``_backward.backward_full``.
    """
    if not roots:  # no gradient reached the outputs: none reaches a weight either
        if pending is not None:
            pending.entries, pending.calls, pending.edges = [], [], []
        return [None] * len(inputs)
    blocks = [c for c in pending.calls if c.waiting] if pending is not None else []
    if pending is None or not (pending.entries or blocks):
        backward_full(roots, grads, keep_graph)
        return [t.grad if t.requires_grad else None for t in inputs]
    wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
    chain = native_chain()
    # The same call, its bookkeeping in C++ (csrc/chain/defer.cpp; it skips
    # the parameters that want no gradient); None there where an edge is a
    # Python autograd.Function's.
    params = params if isinstance(params, list) else list(params)
    native = chain.backward_input(tuple(roots), filled(roots, grads), [inputs[i] for i in wanted],
                                  params, pending.entries, pending.edges, blocks, keep_graph) \
        if chain is not None else None
    if native is not None:
        got, reached, pending.entries = native
        trained = params
    else:  # blocks exist only where the chain is built
        trained = [p for p in params if p.requires_grad]
        block_edges = [chain.block_edges(b) for b in blocks]
        got = run_backward(tuple(roots), filled(roots, grads), keep_graph, False,
                           tuple(inputs[i] for i in wanted) + tuple(trained) + tuple(pending.edges)
                           + tuple(e for edges in block_edges for e in edges),
                           allow_unreachable=True, accumulate_grad=False)
        n = len(wanted)
        reached = [(i, g) for i, g in enumerate(got[n:n + len(trained)]) if g is not None]
        entries, at = pending.entries, n + len(trained) + len(pending.edges)
        pending.entries = [e for e, g in zip(entries, got[n + len(trained):at]) if g is not None]
        for e, g in zip(entries, got[n + len(trained):at]):
            e.g = g
        for b, edges in zip(blocks, block_edges):
            chain.fill_block(b, list(got[at:at + len(edges)]))
            at += len(edges)
    out: list[torch.Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, got):
        out[i] = g
    if reached:
        with torch.no_grad():
            for i, g in reached:
                p = trained[i]
                # A copy where .grad is new: the engine's result may be a
                # received buffer or another tensor's gradient.
                accumulate(p, g if p.grad is not None else g.clone())
                if p._post_accumulate_grad_hooks is not None:  # as AccumulateGrad runs them
                    for hook in tuple(p._post_accumulate_grad_hooks.values()):
                        hook(p)
    pending.edges = []
    return out


def accumulate(p: torch.Tensor, fresh: torch.Tensor) -> None:
    """What AccumulateGrad does with a fresh gradient: store it (cast to the
    parameter's dtype) where ``.grad`` is None, add it in place otherwise."""
    if p.grad is None:
        p.grad = fresh.to(p.dtype) if fresh.dtype != p.dtype else fresh
    else:
        p.grad.add_(fresh)


def run_weight(entries: Sequence[Entry], fuse: bool = True, calls: Sequence = ()) -> None:
    """W: every entry's weight gradients into ``.grad``, and those of the
    native ``calls`` blocks (``Pending.calls``); entries of one layer with a
    row-wise rule are gathered into one call of ``rule.gather``.

    ``fuse=False`` keeps autograd's own rounding: one entry at a time, each
    fresh gradient added to ``.grad`` as AccumulateGrad adds it.
    """
    left = entries
    chain = native_chain()
    if chain is not None:  # the built-in rules' W in C++, without the GIL
        calls = calls if isinstance(calls, list) else list(calls)
        if not entries:  # only native blocks (the usual case): no Python per layer either
            if calls:
                chain.weight_grads((), (), (), fuse, calls)  # it empties the blocks
                calls.clear()
            return
        done = [e for e in entries if e.native is not None]
        if done or calls:
            chain.weight_grads([e.native for e in done], [e.saved[0] for e in done],
                               [e.g for e in done], fuse, calls)
            left = [e for e in entries if e.native is None] if done else entries
    elif calls:
        raise RuntimeError("native weight-gradient calls without fastpipe._chain")
    groups: dict[tuple, list[Entry]] = {}
    for e in left:  # one layer's calls into the same parameters (not a swapped-in replica's)
        groups.setdefault((e.layer, *map(id, e.params)), []).append(e)
    with torch.no_grad():
        for group in groups.values():
            first = group[0]
            if fuse and first.rule.rows(first.saved, first.meta) is not None:
                grads = first.rule.gather(group)
                _store(first.params, grads)
                continue
            for e in group:
                _store(e.params, e.rule.weight_grads(e.saved, e.meta, e.params, e.g))
    for held in (entries, calls):
        if isinstance(held, list):
            held.clear()  # what W read goes now, not with the caller's last reference


def _store(params, grads) -> None:
    for p, g in zip(params, grads):
        if p is not None and g is not None:
            accumulate(p, g)


class WeightQueue:
    """A stage's W work, gathered over microbatches while it is cheap to hold.

    A Linear's weight gradient over few rows is a pass over the whole weight
    matrix for little arithmetic; gathering the rows of several
    microbatches into one GEMM does the same passes once. Entries wait while
    the rows waiting keep fewer bytes than the smallest deferred weight
    matrix of the stage would (``limit_rows``: ``out*in // (out+in)``);
    then, and at the end of the step (``flush``), they run. Memory follows:
    what waits is booked by the executor (``nbytes``).
    """

    def __init__(self) -> None:
        self.waiting: list[Entry] = []
        self.waiting_calls: list = []  # native blocks (``Pending.calls``)
        self.rows = 0
        self.nbytes = 0
        self.limit_rows: int | None = None

    def add(self, pending: Pending, gather: bool = True) -> None:
        """W of one microbatch: runs now, or waits to be gathered (``gather``).

        A tensor in ``pending.borrowed`` memory may be a view of a buffer
        the executor hands back after this W: it is cloned before it waits.
        """
        entries, calls, own = pending.entries, pending.calls, pending.borrowed
        rows, touched, reads = None, None, ()
        if gather:
            rows, touched, reads = self._measure(entries, calls, own)
        if not rows or self.rows + rows >= self._limit(entries, calls):
            entries, calls = self.waiting + entries, self.waiting_calls + calls
            pending.entries, pending.calls = [], []
            self.clear()
            run_weight(entries, gather, calls)
            return
        if touched is None:
            touched = [i for i, e in enumerate(entries)
                       if own and (_within(e.g, own) or any(_within(t, own) for t in e.saved))]
        for i in touched:
            e = entries[i]
            e.saved = tuple(t.clone() if _within(t, own) else t for t in e.saved)
            if _within(e.g, own):
                e.g = e.g.clone()
        for c in reads:
            c.own(own)
        # What waits, each tensor once (a clone above is a tensor of its own).
        self.nbytes += sum(n for _, n in spans(entries, calls))
        self.waiting += entries
        self.waiting_calls += calls
        pending.entries, pending.calls = [], []
        self.rows += rows

    def _measure(self, entries: list[Entry], calls: list, own):
        """(rows or None, entries reading ``own`` memory or None where not
        known, calls reading it) of one microbatch's W work."""
        rows, touched = self._scan(entries, own) if entries else (0, [])
        reads = []
        for c in calls:
            r, read = c.scan(own)
            rows = None if r is None or rows is None else max(rows, r)
            if read:
                reads.append(c)
        return rows, touched, reads

    @staticmethod
    def gathering(pending: Pending) -> tuple[int, int]:
        """(rows, limit) a stage's queue sees for ``pending``'s W: it waits
        while the rows waiting stay under ``limit``; (0, 0) where it runs at
        once. What the planner walks (``LayerProfile.gather_rows``)."""
        queue = WeightQueue()
        rows = queue._measure(pending.entries, pending.calls, ())[0]
        return (rows, queue._limit(pending.entries, pending.calls)) if rows else (0, 0)

    @property
    def holds(self) -> bool:
        """Whether any W work waits."""
        return bool(self.waiting or self.waiting_calls)

    def flush(self) -> None:
        """Runs whatever waits (the end of a step)."""
        run_weight(self.waiting, True, self.waiting_calls)
        self.clear()

    def clear(self) -> None:
        """Drops whatever waits (a failed step), or forgets what has run."""
        self.waiting, self.waiting_calls, self.rows, self.nbytes = [], [], 0, 0

    def _scan(self, entries: list[Entry], own) -> tuple[int | None, list[int] | None]:
        """(rows or None, entries reading ``own`` memory) of a microbatch's
        entries: in C++ where every entry is native, else rows only
        (``_rows``)."""
        chain = native_chain()
        scan = chain.scan_entries(entries, own) if chain is not None else None
        return scan if scan is not None else (self._rows(entries), None)

    @staticmethod
    def _rows(entries: list[Entry]) -> int | None:
        """The rows of a microbatch's Linears; None when there is nothing to
        gather, or when they compute in another dtype than their parameters'
        (autocast): one low-precision GEMM over several microbatches would
        round their sum once in that dtype, where autograd adds each
        microbatch's gradient in the parameter's dtype."""
        rows = 0
        for e in entries:
            r = e.rule.rows(e.saved, e.meta)
            if r is None:
                continue
            dtype = e.g.dtype
            for p in e.params:
                if p is not None and p.dtype != dtype:
                    return None
            if r > rows:
                rows = r
        return rows or None

    def _limit(self, entries: list[Entry], calls: Sequence = ()) -> int:
        if self.limit_rows is None:
            sizes = [e.params[0].shape for e in entries
                     if e.rule.rows(e.saved, e.meta) is not None and e.params[0] is not None]
            limits = [o * i // (o + i) for o, i in sizes]
            limits += [c.limit_rows for c in calls if c.limit_rows is not None]
            self.limit_rows = min(limits, default=0)
        return self.limit_rows


def borrowed_ranges(tensors) -> tuple[tuple[int, int], ...]:
    """The storage address ranges of ``tensors`` (``Pending.borrowed``)."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            out.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    return tuple(out)


def _within(t: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> bool:
    """``t`` reads memory in one of ``ranges`` (live storages do not overlap,
    so its first byte says which storage it is in)."""
    p = t.data_ptr()
    for lo, hi in ranges:
        if lo <= p < hi:
            return True
    return False


# --- collecting: the forward side ------------------------------------------------

_state = threading.local()
_UNSET = object()
_grad_enabled = torch.is_grad_enabled
_FunctionBase = torch._C._FunctionBase  # a Python autograd.Function's node: no GradientEdge of its own


@contextmanager
def collecting(pending: Pending) -> Iterator[Pending]:
    """Layers with a rule called on this thread inside defer into ``pending``.

    Where ``fastpipe._chain`` is built, the native deferring forwards put
    the calls of layers with a native W into one ``Calls`` block of
    ``pending.calls`` (no Python object per call: on threads of one
    interpreter, each such object's free hands the GIL over); every other
    call is an ``Entry``.
    """
    outer = getattr(_state, "pending", None), getattr(_state, "block", None)
    chain = native_chain()
    block = chain.Calls() if chain is not None else None
    _state.pending, _state.block = pending, block
    if chain is not None:  # where the native deferring forwards append
        pending.calls.append(block)
        chain.set_pending(pending.entries, pending.edges, block)
    try:
        yield pending
    finally:
        _state.pending, _state.block = outer
        if chain is not None:
            if not len(block):
                pending.calls.remove(block)
            chain.set_pending(*((outer[0].entries, outer[0].edges, outer[1]) if outer[0] is not None
                                else (None, None, None)))


class _Forward:
    """A layer's ``forward`` while a stage defers: the rule's split where the
    call can defer, the layer class's own ``forward`` otherwise. Set on the
    instance (``install``); counts the stages that installed it.

    What a call needs of its parameters (which train, detached aliases,
    whether the rule accepts the layer, hooks) is worked out once per
    parameter set (``plan``): the F of a small layer is a few microseconds,
    so per-call Python of that order is felt. Making a plan is far more
    work than a call, and the first F of a step is on every rank's
    critical path, so a plan is kept from step to step while the layer is
    as it was planned (``refresh``, at each ``install``). A parameter
    swapped in for one call (a tie's replica in local mode) makes a plan of
    its own; hooks added in the middle of a step are seen from the next."""

    def __init__(self, module: nn.Module, rule: WeightRule) -> None:
        self.module, self.rule, self.users = module, rule, 0
        self.plain = type(module).forward.__get__(module)
        self.layer = id(module)
        # [params, targets, detached params or None where the call cannot
        # defer, the native WeightLayer (_UNSET until the first call makes it),
        # the trained ones' aliases that want a gradient (``_prepare``)]
        self.plan: list | None = None
        self.planned_fast = None  # rule._fast(module) when the native plan was set
        # The native deferring forward (fastpipe._chain.DeferringForward)
        # set on the module in this object's place, for the built-in rules:
        # it runs the calls that match the plan this object hands it. It
        # holds this object; this one holds it weakly, so that no cycle
        # outlives the layer's slot or the stage's ``kept`` (``forward_of``).
        self._native: Callable[[], Any] = lambda: None

    @property
    def fast(self):
        """The native deferring forward set in this object's place, or None."""
        return self._native()

    def reset(self) -> None:
        """Forget the plan: parameters, hooks and flags are read afresh at
        the next call."""
        self.plan = None
        if self.fast is not None:
            self.fast.clear_plan()

    def refresh(self) -> None:
        """A new step: keep the plan only where the layer still is as
        planned: the same parameter objects, each training or frozen as
        then, no hook on them, the detached aliases still viewing their
        memory (``p.data = ...``, as ``module.to()`` does, swaps it), the
        rule still accepting the layer with the same flags (``eps``,
        padding row, ...). A few attribute reads a parameter."""
        plan = self.plan
        if plan is not None and not self._holds(plan):
            self.reset()

    def _holds(self, plan: list) -> bool:
        params, targets, detached, _, _ = plan
        if detached is None:  # the call did not defer: cheap to decide again
            return False
        module, rule = self.module, self.rule
        if self.planned_fast is not None:  # a native plan: its parameters' names are known
            if not native_chain().plan_holds(module._parameters, self.planned_fast[1], params,
                                             targets, detached):
                return False
        elif not _params_hold(rule.params(module), params, targets, detached):
            return False
        if not rule.accepts(module):
            return False
        return self.planned_fast is None or rule._fast(module) == self.planned_fast

    def __call__(self, *args, **kwargs):
        pending = getattr(_state, "pending", None)
        if pending is None or len(args) != 1 or kwargs or not _grad_enabled():
            return self.plain(*args, **kwargs)
        x = args[0]
        module, rule = self.module, self.rule
        params = rule.params(module)
        plan = self.plan
        if plan is None or len(plan[0]) != len(params) or not all(map(operator.is_, params, plan[0])):
            plan = self.plan = self._prepare(params)
        _, targets, detached, layer, aliases = plan
        if detached is None:
            return self.plain(x)
        out, kept, meta = rule.forward(module, x, detached if getattr(x, "requires_grad", False)
                                       else aliases)
        if not out.requires_grad:  # a rule that left the parameters out: a leaf of its own
            out.requires_grad_()
        if layer is _UNSET:  # what W needs of this layer beside each call's tensors
            chain = native_chain()
            layer = plan[3] = rule.native(targets, meta, chain) if chain is not None else None
            if self.fast is not None:  # later calls with these parameters run natively
                self.planned_fast = kind, names, ints, eps = rule._fast(module)
                self.fast.set_plan(kind, module._parameters, names, list(params), list(detached),
                                   list(aliases), ints, eps, rule, targets, meta, self.layer, layer)
        block = getattr(_state, "block", None)
        if layer is not None and block is not None:  # with the native calls, in call order
            native_chain().defer_call(block, layer, kept[0], out)
            return out
        pending.entries.append(Entry(rule, targets, kept, meta, None, self.layer, layer))
        fn = out.grad_fn
        pending.edges.append(GradientEdge(fn, out.output_nr) if fn is not None and not isinstance(
            fn, _FunctionBase) else get_gradient_edge(out))
        return out

    def _prepare(self, params: tuple) -> tuple:
        # W accumulates into the parameters called with (a replica swapped in
        # for this call, under local ties), not whatever the module holds later.
        targets = tuple(p if p is not None and p.requires_grad else None for p in params)
        # A weight computed from others (torch.nn.utils.parametrize) is no
        # leaf: its gradient must flow on through autograd to what made it.
        ok = any(t is not None for t in targets) and self.rule.accepts(self.module) and not any(
            param_hooked(p) or not p.is_leaf for p in targets if p is not None)
        detached = tuple(p.detach() if p is not None else None for p in params) if ok else None
        # Where the input wants no gradient (the ids of an Embedding, a
        # stage's first input), the op runs on aliases that want one: its
        # output then has a node of the op's own, which saves what the op's
        # backward would (nothing more: the node never runs, I asks only for
        # the gradient at it), where a leaf output would be held by its
        # AccumulateGrad node, whatever is saved, until I.
        aliases = tuple(d.detach().requires_grad_() if t is not None else d
                        for d, t in zip(detached, targets)) if ok else None
        return [tuple(params), targets, detached, _UNSET, aliases]


def _params_hold(now, params, targets, detached) -> bool:
    """``_Forward._holds``'s look at the parameters (``fastpipe._chain.plan_holds``
    makes it in C++ for native plans)."""
    if len(now) != len(params):
        return False
    for p, planned, t, d in zip(now, params, targets, detached):
        if p is not planned:
            return False
        if p is None:
            continue
        if p.requires_grad != (t is not None) or (t is not None and param_hooked(t)):
            return False
        if (d.data_ptr() != p.data_ptr() or d.dtype != p.dtype or d.shape != p.shape
                or d.stride() != p.stride()):
            return False
    return True


_configured: list[ModuleType] = []


def forward_of(module: nn.Module, rule: WeightRule):
    """What ``install`` sets as ``module``'s ``forward``: the native deferring
    forward for the built-in rules where it is built (it holds the
    ``_Forward``, which refers back weakly), else the ``_Forward``."""
    fwd = _Forward(module, rule)
    chain = _native_forwards()
    if chain is None or rule._fast is None:
        return fwd
    native = chain.DeferringForward(fwd)
    fwd._native = weakref.ref(native)
    return native


def _native_forwards() -> ModuleType | None:
    """``fastpipe._chain``, told (once) which Entry and GradientEdge its
    deferring forwards build; None where it is not built."""
    chain = native_chain()
    if chain is not None and not _configured:
        chain.configure_defer(Entry, GradientEdge)
        _configured.append(chain)
    return chain


def install(root: nn.Module, kept: dict | None = None) -> list[nn.Module]:
    """Sets the deferring ``forward`` on every layer under ``root`` with a
    rule (not inside a compiled module, not where ``forward`` is already
    set on the instance). Returns the layers, for ``uninstall``.

    ``kept`` (a stage's: ``{id(layer): what install set as its forward}``)
    keeps the deferring forwards, and so their plans, from one step to the
    next; each plan is checked afresh (``_Forward.refresh``). Kept plans
    hold the layers' parameters as the stage does; a parameter or layer
    replaced between steps is let go at the next step, or with ``kept``."""
    done = []
    seen = set()
    for m in _modules_outside_compiled(root):
        rule = rule_for(type(m))
        if rule is None:
            continue
        seen.add(id(m))
        fwd = _installed(m)
        if fwd is None:
            if "forward" in m.__dict__:
                continue  # the user's own forward on this instance: keep it
            held = kept.get(id(m)) if kept is not None else None
            fwd = getattr(held, "slow", held)
            if fwd is None or fwd.module is not m or fwd.rule is not rule:
                held = forward_of(m, rule)
                fwd = getattr(held, "slow", held)
                if kept is not None:
                    kept[id(m)] = held
            m.__dict__["forward"] = held
        fwd.users += 1
        fwd.refresh()  # a new step: the plan stays only if the layer is as planned
        done.append(m)
    if kept is not None and not seen.issuperset(kept):  # layers no longer under root
        for gone in [k for k in kept if k not in seen]:
            del kept[gone]
    return done


def uninstall(layers: list[nn.Module]) -> None:
    """Undoes one ``install``: the class ``forward`` is back once no stage
    uses it (its plan then lives on only where ``install`` was given ``kept``)."""
    for m in layers:
        fwd = _installed(m)
        if fwd is not None:
            fwd.users -= 1
            if fwd.users == 0:
                del m.__dict__["forward"]
    layers.clear()


def _installed(m: nn.Module) -> _Forward | None:
    """The deferring forward ``install`` set on ``m``, or None."""
    fwd = m.__dict__.get("forward")
    fwd = getattr(fwd, "slow", fwd)  # the native one runs on behalf of a _Forward
    return fwd if isinstance(fwd, _Forward) else None


def _modules_outside_compiled(root: nn.Module) -> list[nn.Module]:
    """``root`` and its submodules, depth first, but none inside a compiled
    module (read from ``_modules``: this runs for every stage at every step)."""
    out, stack = [], [root]
    while stack:
        m = stack.pop()
        if type(m).__name__ == "OptimizedModule":  # torch.compile's wrapper
            continue
        out.append(m)
        subs = m._modules
        if subs:
            stack.extend(reversed([c for c in subs.values() if c is not None]))
    return out


# The built-in rules register themselves (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Embedding).
from fastpipe.runtime.weight_rules import (  # noqa: E402
    EmbeddingRule, LayerNormRule, LinearRule, RMSNormRule,
)
