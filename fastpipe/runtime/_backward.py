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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightGroup:
    """One autograd call of W: restart at ``edges`` and stop at ``params``
    (the parameters' AccumulateGrad edges)."""

    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    params: list[GradientEdge] = field(default_factory=list)


@dataclass
class WeightWork:
    """What ``backward_weight`` needs: one group per cut node (and per root
    whose graph never reaches the inputs)."""

    groups: list[WeightGroup] = field(default_factory=list)


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
    _run_backward(tuple(roots), _filled(roots, grads), keep_graph, False, (),
                  allow_unreachable=True, accumulate_grad=True)


def _filled(roots: Sequence[Root], grads: Sequence[torch.Tensor | None]) -> tuple:
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
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        kids = [n for n, _ in node.next_functions if n is not None]
        children[node] = kids
        if type(node) is _ACCUMULATE:
            leaves.append(node)
        stack.append((node, True))
        stack.extend((c, False) for c in kids if c not in children)
    return children, order, leaves


def _classify(children: dict[Node, list[Node]], order: list[Node], input_nodes: set[Node],
              by_node: dict[Node, GradientEdge]) -> tuple[dict[Node, bool], dict[Node, list[GradientEdge]]]:
    """One pass over the graph, children first: for every node whether it
    reaches an input, and for every *weight-only* node (reaches parameters
    but no input) the edges of the parameters below it."""
    to_input: dict[Node, bool] = {}
    below: dict[Node, list[GradientEdge]] = {}
    for node in order:
        kids = children[node]
        if node in input_nodes or any(to_input.get(c, False) for c in kids):
            to_input[node] = True
            continue
        to_input[node] = False
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
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """I: gradients for ``inputs`` only, keeping what W needs for ``params``.

    Returns:
        The input gradients (None where an input gets none) and the pending
        weight work to pass to ``backward_weight``.
    """
    work = WeightWork()
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
    for edge, g in zip(cut_edges, cut_grads):
        if g is None:  # the node did not run, or that output got no gradient
            continue
        group = kept_by_node.get(edge.node)
        if group is None:
            group = kept_by_node[edge.node] = WeightGroup(params=cut_params[edge.node])
            work.groups.append(group)
        group.edges.append(edge)
        group.grads.append(g)
    # Roots whose graph never touches the inputs (the first stage, whose input
    # needs no gradient): W runs their whole backward.
    for root, grad in zip(roots, grads):
        node = _node(root)
        if node in below:
            g = grad if grad is not None else torch.ones_like(root)  # None only for a loss tensor
            work.groups.append(WeightGroup([_edge(root)], [g], below[node]))
    return input_grads, work


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
        tuple(roots), _filled(roots, grads),
        True,  # W still needs the saved tensors
        False, tuple(inputs[i] for i in wanted) + tuple(extra), allow_unreachable=True,
        accumulate_grad=False,
    )
    for i, g in zip(wanted, got):
        out[i] = g
    return out, tuple(got[len(wanted):])


def backward_weight(work: WeightWork, keep_graph: bool = False) -> None:
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
    """
    groups = [g for g in work.groups if g.params]
    for i, group in enumerate(groups):
        # Groups can share nodes below their cuts, so only the last call may
        # free what it ran (W is the graph's last use). On a first stage, W
        # is the whole backward in one call: freeing as it goes lets later
        # gradients reuse warm memory (10-15 % of W on CPU).
        keep = keep_graph or i < len(groups) - 1
        _run_backward(tuple(group.edges), tuple(group.grads), keep, False,
                      tuple(group.params), allow_unreachable=True, accumulate_grad=True)
    work.groups.clear()


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
