"""Backward passes of one stage: full (B), input-only (I) and weight-only (W).

Zero-bubble schedules split a stage's backward in two. ``I`` must produce the
gradient the previous stage is waiting for as early as possible; ``W`` fills
idle time later. Running autograd twice from the stage outputs would compute
the input-gradient path twice, so ``I`` records where the weight-only part of
the graph hangs off the input path, and ``W`` restarts autograd from there:

    outputs ──► N1 ──► N2 ──► ... ──► inputs        (I walks this path)
                │      │
                ▼      ▼
             weights weights                        (W walks only these)

A *cut node* is a node on the input path with an edge into a subgraph that
reaches parameters but not the inputs (for a Linear: its AddmmBackward). Its
incoming gradient is complete when I runs it; a pre-hook keeps that gradient
and W calls autograd on ``GradientEdge(cut node, i)`` with it.

Where the saved tensors are freed matters when several threads run stages
in one interpreter (local mode). A tensor that Python has seen keeps its
Python object while C++ holds it, and dropping the last C++ reference (the
graph's saved copy) takes the GIL to release that object. An engine that
frees the graph as it goes (``retain_graph=False``) therefore takes the GIL
once per saved tensor, and while another thread runs Python each of those
waits for a hand-over. On the narrow benchmark stage (4 MLP blocks, d=128,
16 microbatches of 4 rows) one backward call took 7.6 ms alone and 1.1 s next
to a thread spinning in Python; two threads, each running 20 passes of
forward and backward over its microbatches, took 418 ms against 273 ms for
one thread alone. With ``keep_graph=True`` the engine frees nothing: the
graph goes when the caller drops its roots, on a thread that holds the GIL
already; the same backward took 15 ms next to the spinning thread and the two
threads 297 ms.

The cost is memory: a microbatch's saved tensors stay until its backward
returns instead of going as the engine passes them, so the peak can hold one
stage's activations of one microbatch longer. Distributed ranks (one Python
thread doing the work) keep the default and free as they go.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from fastpipe._ext import native


@dataclass(frozen=True)
class _Linear:
    """The matmul node of an ``nn.Linear`` (``addmm`` with a bias, ``mm``
    without) and the AccumulateGrad nodes of its weight and bias."""

    node: Node
    weight: Node
    bias: Node | None


@dataclass
class WeightGroup:
    """One autograd call of W: restart at ``edges`` and stop at ``params``
    (the parameters' AccumulateGrad edges)."""

    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    params: list[GradientEdge] = field(default_factory=list)
    # The cut node is a Linear's matmul (and its weight branch nothing else):
    # W computes the weight gradient itself (fused mode: one addmm_ into
    # .grad; otherwise into a reusable buffer that autograd accumulates).
    linear: _Linear | None = None
    # Fused mode: a root group (the stage's input needs no gradient): W runs
    # the whole backward with every Linear fused (``backward_fused``).
    whole: bool = False


@dataclass
class WeightWork:
    """What ``backward_weight`` needs: one group per cut node (and per root
    whose graph never reaches the inputs)."""

    groups: list[WeightGroup] = field(default_factory=list)
    fused: bool = False  # made by a fused I: W accumulates plain Linears natively


Root = torch.Tensor | GradientEdge  # a stage output, or the graph edge it came from


def _node(root: Root) -> Node | None:
    return root.grad_fn if isinstance(root, torch.Tensor) else root.node


def _edge(root: Root) -> GradientEdge:
    return get_gradient_edge(root) if isinstance(root, torch.Tensor) else root


def backward_full(roots: Sequence[Root], grads: Sequence[torch.Tensor | None],
                  keep_graph: bool = False) -> None:
    """B: one autograd pass; parameter and (leaf) input ``.grad`` accumulate.

    ``keep_graph=True`` leaves the saved tensors to be freed with the graph,
    when the caller drops its roots (see the module docstring: why threads
    that share one interpreter want that).
    """
    if not roots:
        return
    # The engine directly, as W calls it: ``autograd.backward``'s argument
    # handling is a dozen small ops, and each op hands the GIL over when
    # another rank's thread wants it (next to a forward on another thread,
    # that wrapper made the forward 2.5x slower).
    _run_backward(tuple(roots), filled(roots, grads), keep_graph, False, (),
                  allow_unreachable=True, accumulate_grad=True)


def filled(roots: Sequence[Root], grads: Sequence[torch.Tensor | None]) -> tuple:
    """The gradients to start from: None (a loss's) is 1, as in ``Tensor.backward()``."""
    return tuple(torch.ones_like(r) if g is None else g for r, g in zip(roots, grads))


_ACCUMULATE = torch._C._functions.AccumulateGrad


def _graph(roots: list[Node]) -> tuple[dict[Node, list[Node]], list[Node], list[Node]]:
    """Every node reachable from ``roots`` with its children (read once: each
    ``next_functions`` access builds a new tuple), a post-order of them, and
    the AccumulateGrad nodes among them (the graph's leaves)."""
    children: dict[Node, list[Node]] = {}
    order: list[Node] = []
    leaves: list[Node] = []
    # Iterative post-order DFS: stage graphs can be deep (thousands of nodes).
    # Plain loops, no generators: this runs once per I and B-fused on every
    # microbatch, and on narrow stages its Python is a third of I.
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    push, pop = stack.append, stack.pop
    while stack:
        node, expanded = pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        kids = [n for n, _ in node.next_functions if n is not None]
        children[node] = kids
        if type(node) is _ACCUMULATE:
            leaves.append(node)
        push((node, True))
        for c in kids:
            if c not in children:
                push((c, False))
    return children, order, leaves


def _classify(children: dict[Node, list[Node]], order: list[Node], input_nodes: set[Node],
              by_node: dict[Node, GradientEdge]) -> tuple[dict[Node, bool], dict[Node, list[GradientEdge]]]:
    """One pass over the graph, children first: for every node whether it
    reaches an input, and for every *weight-only* node (reaches parameters
    but no input) the edges of the parameters below it."""
    to_input: dict[Node, bool] = {}
    below: dict[Node, list[GradientEdge]] = {}
    reaches = to_input.get
    for node in order:
        kids = children[node]
        hit = node in input_nodes
        if not hit:
            for c in kids:
                if reaches(c, False):
                    hit = True
                    break
        to_input[node] = hit
        if hit:
            continue
        own = by_node.get(node)
        parts = [below[c] for c in kids if c in below]
        if own is not None:
            parts.append([own])
        if parts:
            below[node] = parts[0] if len(parts) == 1 else _union(parts)
    return to_input, below


def _union(parts: list[list[GradientEdge]]) -> list[GradientEdge]:
    """The edges of ``parts``, each parameter once (a subgraph can reach one twice)."""
    if len(parts) == 1:
        return parts[0]
    return list({e.node: e for part in parts for e in part}.values())


def backward_input(
    roots: Sequence[Root],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    keep_graph: bool = False,
    fused: bool = False,
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """I: gradients for ``inputs`` only, keeping what W needs for ``params``.

    ``fused``: W accumulates the weight gradient of each Linear whose matmul
    is a cut node with one ``addmm_`` (see ``backward_fused``), and a stage
    whose input needs no gradient runs its whole W that way.

    Returns:
        The input gradients (None where an input gets none) and the pending
        weight work to pass to ``backward_weight``.
    """
    work = WeightWork(fused=fused)
    root_nodes = [n for n in map(_node, roots) if n is not None]
    children, order, leaves = _graph(root_nodes)
    # A leaf's AccumulateGrad node, found in the graph by its ``variable``:
    # get_gradient_edge on a leaf builds a view to find it (~8 us a tensor).
    param_ids = {id(p) for p in params if p.requires_grad}
    leaf_inputs = {id(t) for t in inputs if t.requires_grad and t.grad_fn is None}
    by_node: dict[Node, GradientEdge] = {}
    input_nodes = {t.grad_fn for t in inputs if t.grad_fn is not None}
    for leaf in leaves:
        var = id(leaf.variable)
        if var in param_ids:
            by_node[leaf] = GradientEdge(leaf, 0)
        elif var in leaf_inputs:
            input_nodes.add(leaf)
    to_input, below = _classify(children, order, input_nodes, by_node)
    cut_params: dict[Node, list[GradientEdge]] = {}
    for node, reaches_input in to_input.items():
        if not reaches_input:
            continue
        branches = [below[c] for c in children[node] if c in below]
        if branches:
            cut_params[node] = _union(branches)
    if _shared_between_cuts(cut_params):
        # A weight used twice in the stage is reachable from an upper cut
        # through the input path, so restarting there would count the lower
        # use twice. Do the whole backward now; W has nothing left to do.
        backward_full(roots, grads, keep_graph)
        return [t.grad if t.requires_grad else None for t in inputs], work
    # The engine keeps each cut node's incoming gradients itself: they are
    # asked for as extra outputs (one edge per input of the node), so no
    # Python hook runs inside the engine (in local mode each would take the
    # GIL from another rank's thread).
    cut_edges = [GradientEdge(node, i) for node in cut_params
                 for i in range(len(node._input_metadata))]
    input_grads, cut_grads = _input_grads(roots, grads, inputs, cut_edges)
    kept_by_node: dict[Node, WeightGroup] = {}
    parents: Counter | None = None  # how many edges point at each node, once needed
    for edge, g in zip(cut_edges, cut_grads):
        if g is None:  # the node did not run, or that output got no gradient
            continue
        group = kept_by_node.get(edge.node)
        if group is None:
            group = kept_by_node[edge.node] = WeightGroup(params=cut_params[edge.node])
            if type(edge.node).__name__ in _LINEAR_KINDS and (fused or _may_use_workspace(edge.node)):
                if parents is None:
                    parents = Counter(k for kids in children.values() for k in kids)
                group.linear = _cut_linear(edge.node, parents, param_ids, group.params)
            work.groups.append(group)
        group.edges.append(edge)
        group.grads.append(g)
    # Roots whose graph never touches the inputs (the first stage, whose input
    # needs no gradient): W runs their whole backward.
    for root, grad in zip(roots, grads):
        node = _node(root)
        if node in below:
            g = grad if grad is not None else torch.ones_like(root)  # None only for a loss tensor
            work.groups.append(WeightGroup([_edge(root)], [g], below[node], whole=fused))
    return input_grads, work


def _cut_linear(node: Node, parents: Counter, param_ids: set[int], params: list[GradientEdge]
                ) -> _Linear | None:
    """The Linear of a cut node when its weight branch holds nothing else."""
    lin = _linear_of(node, parents, param_ids)
    if lin is None or {e.node for e in params} != {lin.weight, lin.bias} - {None}:
        return None
    return lin


def _shared_between_cuts(cut_params: dict[Node, list[GradientEdge]]) -> bool:
    seen: set[Node] = set()
    for params in cut_params.values():
        for p in params:
            if p.node in seen:
                return True
            seen.add(p.node)
    return False


def _input_grads(roots, grads, inputs, extra: Sequence[GradientEdge] = ()
                 ) -> tuple[list[torch.Tensor | None], tuple]:
    """Gradients for ``inputs`` (None where one needs none) and for the
    ``extra`` edges, in one engine pass that keeps the graph for W."""
    wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
    out: list[torch.Tensor | None] = [None] * len(inputs)
    if not wanted and not extra:
        return out, ()
    got = _run_backward(  # what autograd.grad calls (see backward_full)
        tuple(roots), filled(roots, grads),
        True,  # W still needs the saved tensors
        False, tuple(inputs[i] for i in wanted) + tuple(extra), allow_unreachable=True,
        accumulate_grad=False,
    )
    for i, g in zip(wanted, got):
        out[i] = g
    return out, tuple(got[len(wanted):])


def backward_weight(work: WeightWork, keep_graph: bool = False,
                    workspace: dict | None = None) -> None:
    """W: accumulate parameter gradients from the edges I kept.

    One autograd call per group: a single call from all edges would also walk
    the input path between them again (and count lower layers twice).
    Accumulating into ``.grad`` as each weight gradient is computed (like a
    plain backward, ``autograd.backward(inputs=...)``) matters: collecting
    them with ``autograd.grad`` first kept every fresh gradient buffer alive
    to the end of the call and then read it again, which made W on a stage
    of 2048-wide Linears up to twice as slow as the whole B. ``keep_graph``
    as in ``backward_full``: the graph then goes with ``work.groups``.

    The engine is called the way ``autograd.backward`` calls it, without its
    argument checks: the kept gradients came out of the engine with the
    right shapes, and the checks cost ~15 us per group, a third of W on a
    stage of narrow Linears.

    ``workspace`` (a dict kept per stage across steps): a Linear's weight
    gradient is computed into a buffer reused from call to call, and autograd
    accumulates it from the weight's AccumulateGrad node, hooks included
    (``_linear_into_workspace``). Restarting at the matmul node instead lets
    autograd allocate a fresh weight-sized matrix per call, and with glibc's
    allocator those often come from fresh pages: torch asks for 64-byte
    aligned blocks, which glibc 2.36 does not serve from the block just
    freed once a small allocation sits next to it. On 2048x512 Linears that
    was ~1000-2000 page faults per W (W 8.7-9.2 ms against 6.2-7.9 ms with
    the buffer). CPU only: GPU memory comes from torch's caching allocator,
    and a buffer reused across the engine's streams would need events.
    """
    groups = [g for g in work.groups if g.params]
    # Fused mode: every Linear of the stage in one native call, first.
    fused = [(g.linear, g.grads[0]) for g in groups if work.fused and g.linear is not None
             and _plain([e.node.variable for e in g.params])]
    if fused:
        with torch.no_grad():
            _accumulate_linears(fused)
        done = {id(lin) for lin, _ in fused}
        groups = [g for g in groups if g.linear is None or id(g.linear) not in done]
    if workspace is not None:
        groups = [g for g in groups if g.linear is None
                  or not _linear_into_workspace(g.linear, g.grads[0], g.params, workspace)]
    for i, group in enumerate(groups):
        if group.whole and backward_fused(group.edges, group.grads, (),
                                          [e.node.variable for e in group.params]) is not None:
            continue
        # Groups can share nodes below their cuts, so only the last call may
        # free what it ran (W is the graph's last use). On a first stage, W
        # is the whole backward in one call: freeing as it goes lets later
        # gradients reuse warm memory (10-15 % of W on CPU).
        keep = keep_graph or i < len(groups) - 1
        _run_backward(tuple(group.edges), tuple(group.grads), keep, False,
                      tuple(group.params), allow_unreachable=True, accumulate_grad=True)
    work.groups.clear()


# Smaller weights keep the restart: their fresh gradients are cheap to fault in,
# and the extra torch op per Linear cost more than it saved on narrow stages
# (local mode, d=128: zbv 45.1-45.7 -> 50.8-54.3 ms a step with the buffer).
_WORKSPACE_MIN_BYTES = 1 << 20


def _may_use_workspace(node: Node) -> bool:
    """A cheap first test in I, before the Linear's structure is checked:
    could the matmul's weight reach ``_WORKSPACE_MIN_BYTES`` (2 bytes an
    element at the least)? On narrow stages the full check for every cut
    node made I ~10 % slower (355 -> 386-399 us, d=128)."""
    sizes = node._saved_mat2_sym_sizes
    return sizes[0] * sizes[1] * 2 >= _WORKSPACE_MIN_BYTES


def _linear_into_workspace(lin: _Linear, g: torch.Tensor, params: list[GradientEdge],
                           workspace: dict) -> bool:
    """W of one Linear cut node through a reused buffer; False (nothing done)
    where it does not apply.

    The weight gradient is computed as the matmul node would compute it
    (``mm_mat2_backward`` for a transposed ``W.t()``: ``g.t() @ x``, the
    same kernel, so the same bits), into a buffer kept in ``workspace``;
    then one engine call from the weight's and the bias's AccumulateGrad
    nodes, with ``g`` for the bias (the engine sums it over rows as it does
    for the matmul's own output). The engine thus accumulates, runs the
    parameters' hooks and frees nothing of ours. It must not keep the
    buffer: so only where ``.grad`` exists already (accumulation adds into
    it; a missing ``.grad`` could be the buffer itself, stolen) and no
    tensor hook could keep the gradient it is shown; and only for CPU
    weights of 1 MiB or more (``_WORKSPACE_MIN_BYTES``).
    """
    node = lin.node
    w = lin.weight.variable
    if w.device.type != "cpu" or w.numel() * w.element_size() < _WORKSPACE_MIN_BYTES:
        return False
    b = lin.bias.variable if lin.bias is not None else None
    for p in (w, b):
        if p is not None and (p.grad is None or p._backward_hooks):
            return False
    sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides
    x = _saved_input(lin)
    if (strides[0] != 1 or strides[1] != sizes[0] or g.dim() != 2 or x.dim() != 2
            or w.layout != torch.strided or g.layout != torch.strided
            or g.dtype != w.dtype or x.dtype != w.dtype or g.device != w.device):
        return False
    key = (tuple(w.shape), w.dtype, w.device)
    buf = workspace.get(key)
    if buf is None:
        buf = workspace[key] = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        torch.mm(g.t(), x, out=buf)
    edges, grads = [GradientEdge(lin.weight, 0)], [buf]
    if b is not None:
        edges.append(GradientEdge(lin.bias, 0))
        grads.append(g)
    _run_backward(tuple(edges), tuple(grads), True, False, tuple(params), allow_unreachable=True,
                  accumulate_grad=True)
    return True


# --- fused weight gradients (opt-in) -------------------------------------------
#
# autograd computes a Linear's weight gradient as a fresh (out, in) matrix,
# which AccumulateGrad then adds into ``.grad``: one write of the matrix,
# then two reads and another write. With few rows per microbatch that memory
# traffic is the whole cost: for a 2048x512 weight and 8 rows, mm + add took
# 516 us on the benchmark CPU and ``grad.addmm_(g.t(), x)`` 216 us (Megatron
# fuses the same accumulation on GPUs). In fused mode the engine stops at
# each Linear's matmul node (its incoming gradient is an extra output of
# the call, so the weight branch below it is skipped) and one addmm_ per
# Linear accumulates the weight gradient, ``g.sum(0)`` the bias's. What it
# skips: hooks registered on the AccumulateGrad nodes themselves
# (``grad_fn``-level hooks, C++ hooks such as DDP's reducer), which Python
# cannot see; parameters with tensor hooks keep the engine's path.

_LINEAR_KINDS = {"AddmmBackward0": (2, "_saved_mat1"), "MmBackward0": (1, "_saved_self")}


def _linear_of(node: Node, parents: Counter, param_ids: set[int]) -> _Linear | None:
    """``node`` as the matmul of a Linear (``x @ W.t()`` [+ b]) whose weight
    and bias are parameters of the stage used nowhere else, or None."""
    kind = _LINEAR_KINDS.get(type(node).__name__)
    if kind is None:
        return None
    nxt = node.next_functions
    t = nxt[kind[0]][0]
    if t is None or type(t).__name__ != "TBackward0" or parents[t] != 1:
        return None
    weight = t.next_functions[0][0]
    if type(weight) is not _ACCUMULATE or parents[weight] != 1 or id(weight.variable) not in param_ids:
        return None
    bias = None
    if kind[0] == 2:
        if node._saved_alpha != 1 or node._saved_beta != 1:
            return None
        bias = nxt[0][0]
        if bias is not None and (type(bias) is not _ACCUMULATE or parents[bias] != 1
                                 or id(bias.variable) not in param_ids):
            return None
    return _Linear(node, weight, bias)


def _plain(tensors) -> bool:
    """True when accumulating into ``.grad`` by hand does what AccumulateGrad
    would: no tensor hooks, a dense parameter and gradient alike."""
    for p in tensors:
        if p._backward_hooks or p._post_accumulate_grad_hooks is not None or not p.is_contiguous():
            return False
        g = p.grad
        if g is not None and (g.layout != torch.strided or g.dtype != p.dtype or g.shape != p.shape
                              or g.device != p.device or g.requires_grad or not g.is_contiguous()):
            return False
    return True


@functools.cache
def _native_blas() -> bool:
    """Hands torch's own sgemm_/dgemm_ to the native accumulation, once.

    False where torch's CPU library does not export them (the torch ops
    below then do the work, GIL hand-overs included).
    """
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        sgemm, dgemm = lib.sgemm_, lib.dgemm_
    except (OSError, AttributeError):
        return False
    address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    native()._set_blas(address(sgemm), address(dgemm))
    return True


_NATIVE_DTYPES = (torch.float32, torch.float64)


def _accumulate_linears(pairs: Sequence[tuple[_Linear, torch.Tensor]]) -> None:
    """``accumulate_linear_grads`` for cut Linears and their incoming gradients."""
    accumulate_linear_grads([
        (lin.weight.variable, lin.bias.variable if lin.bias is not None else None, g,
         _saved_input(lin))
        for lin, g in pairs
    ])


def accumulate_linear_grads(
    items: Sequence[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]],
) -> None:
    """For each (weight, bias, g, x): ``W.grad += g.t() @ x`` (and ``b.grad += g.sum(0)``).

    CPU fp32/fp64 Linears go to one native call that runs them all without
    the GIL (``csrc/accumulate.cpp``); the rest take torch ops.
    """
    native_items, f64, kept, rest = [], [], [], []
    use_native = _native_blas()
    for w, b, g, x in items:
        k = g.shape[0] if g.dim() == 2 else -1
        if not (use_native and w.device.type == "cpu" and w.dtype in _NATIVE_DTYPES
                and g.dtype == w.dtype and x.dtype == w.dtype and w.dim() == 2
                and tuple(g.shape) == (k, w.shape[0]) and tuple(x.shape) == (k, w.shape[1])
                and g.is_contiguous() and x.is_contiguous()):
            rest.append((w, b, g, x))
            continue
        overwrite = w.grad is None and (b is None or b.grad is None)
        if overwrite:
            w.grad = torch.empty_like(w)
            if b is not None:
                b.grad = torch.empty_like(b)
        else:  # one of the two had no gradient yet
            for p in (w, b):
                if p is not None and p.grad is None:
                    p.grad = torch.zeros_like(p)
        bias = b.grad.data_ptr() if b is not None else 0
        native_items.append((w.grad.data_ptr(), g.data_ptr(), x.data_ptr(), w.shape[0],
                             w.shape[1], k, bias, overwrite))
        f64.append(w.dtype == torch.float64)
        kept.append((g, x))  # alive until the call returns
    if native_items:
        native()._accumulate_linear_grads(native_items, f64)
    with torch.no_grad():
        for w, b, g, x in rest:
            if w.grad is None:
                w.grad = torch.mm(g.t(), x)
            else:
                w.grad.addmm_(g.t(), x)
            if b is not None:
                _accumulate(b, g.sum(0))


def _saved_input(lin: _Linear) -> torch.Tensor:
    return getattr(lin.node, _LINEAR_KINDS[type(lin.node).__name__][1])


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = torch.empty_like(p).copy_(g)  # the engine's result may alias other tensors
    else:
        p.grad.add_(g)


def backward_fused(roots: Sequence[Root], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                   ) -> list[torch.Tensor | None] | None:
    """B with each Linear's weight gradient accumulated by one ``addmm_``.

    One engine call computes the gradients of ``inputs`` and the incoming
    gradient of every Linear matmul node; the other leaves of the graph
    (norm weights, biases of other layers) get theirs from the same call
    and are accumulated by hand. The graph is kept (the addmm_ reads the
    saved input of each Linear): it goes when the caller drops ``roots``.

    Returns:
        The input gradients (None where an input needs none), or None when
        the graph has no Linear to fuse or a parameter has tensor hooks;
        nothing has run then and the caller does a plain backward.
    """
    root_nodes = [n for n in map(_node, roots) if n is not None]
    children, _, leaves = _graph(root_nodes)
    parents = Counter(k for kids in children.values() for k in kids)
    param_ids = {id(p) for p in params if p.requires_grad}
    linears = [lin for lin in (_linear_of(n, parents, param_ids) for n in children) if lin is not None]
    if not linears:
        return None
    covered = {lin.weight for lin in linears} | {lin.bias for lin in linears if lin.bias is not None}
    input_ids = {id(t) for t in inputs}
    others = [leaf for leaf in leaves if leaf not in covered and id(leaf.variable) not in input_ids]
    if not _plain([leaf.variable for leaf in covered] + [leaf.variable for leaf in others]):
        return None
    wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
    edges = [GradientEdge(lin.node, 0) for lin in linears] + [GradientEdge(leaf, 0) for leaf in others]
    got = _run_backward(tuple(roots), filled(roots, grads), True, False,
                        tuple(inputs[i] for i in wanted) + tuple(edges),
                        allow_unreachable=True, accumulate_grad=False)
    out: list[torch.Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, got):
        out[i] = g
    rest = got[len(wanted):]
    with torch.no_grad():
        _accumulate_linears([(lin, g) for lin, g in zip(linears, rest) if g is not None])
        for leaf, g in zip(others, rest[len(linears):]):
            if g is not None:
                _accumulate(leaf.variable, g)
    return out


def _public_run_backward(edges, grads, keep_graph, create_graph, inputs, allow_unreachable,
                         accumulate_grad):
    if not accumulate_grad:
        return torch.autograd.grad(list(edges), list(inputs), list(grads), retain_graph=keep_graph,
                                   allow_unused=allow_unreachable)
    torch.autograd.backward(list(edges), list(grads), retain_graph=keep_graph,
                            inputs=list(inputs) or None)
    return ()


# torch.autograd.backward's own engine entry (keeps its TLS context and
# logging hooks); the public call where a torch version lacks it.
_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", _public_run_backward)
run_backward = _run_backward
