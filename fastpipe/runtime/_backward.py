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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightGroup:
    """One autograd call of W: restart at ``edges`` and stop at ``params``."""

    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


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


def backward_full(roots: Sequence[Root], grads: Sequence[torch.Tensor | None]) -> None:
    """B: one autograd pass; parameter and (leaf) input ``.grad`` accumulate."""
    if roots:
        torch.autograd.backward(list(roots), list(grads))


def _graph(roots: list[Node]) -> tuple[dict[Node, list[Node]], list[Node]]:
    """Every node reachable from ``roots`` with its children (read once: each
    ``next_functions`` access builds a new tuple), and a post-order of them."""
    children: dict[Node, list[Node]] = {}
    order: list[Node] = []
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
        stack.append((node, True))
        stack.extend((c, False) for c in kids if c not in children)
    return children, order


def _reach(children: dict[Node, list[Node]], order: list[Node], targets: set[Node]) -> dict[Node, bool]:
    """For every node of the graph: can it reach one of ``targets``?"""
    memo: dict[Node, bool] = {}
    for node in order:  # children come before their parents
        memo[node] = node in targets or any(memo.get(c, False) for c in children[node])
    return memo


def backward_input(
    roots: Sequence[Root],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """I: gradients for ``inputs`` only, keeping what W needs for ``params``.

    Returns:
        The input gradients (None where an input gets none) and the pending
        weight work to pass to ``backward_weight``.
    """
    work = WeightWork()
    root_nodes = [n for n in map(_node, roots) if n is not None]
    by_node = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
    input_nodes = {get_gradient_edge(t).node for t in inputs if t.requires_grad}
    children, order = _graph(root_nodes)
    to_input = _reach(children, order, input_nodes)
    to_param = _reach(children, order, set(by_node))

    def weight_only(node: Node | None) -> bool:
        return node is not None and to_param.get(node, False) and not to_input.get(node, False)

    captured: dict[Node, tuple] = {}
    handles = []
    cut_params: dict[Node, list[torch.Tensor]] = {}
    for node, reaches_input in to_input.items():
        if not reaches_input:
            continue
        branches = [c for c in children[node] if weight_only(c)]
        if branches:
            cut_params[node] = _params_below(branches, by_node, children)
    if _shared_between_cuts(cut_params):
        # A weight used twice in the stage is reachable from an upper cut
        # through the input path, so restarting there would count the lower
        # use twice. Do the whole backward now; W has nothing left to do.
        backward_full(roots, grads)
        return [t.grad if t.requires_grad else None for t in inputs], work
    for node in cut_params:
        handles.append(node.register_prehook(_keeper(captured, node)))
    try:
        input_grads = _input_grads(roots, grads, inputs)
    finally:
        for h in handles:
            h.remove()
    for node, node_grads in captured.items():
        edges = [GradientEdge(node, i) for i, g in enumerate(node_grads) if g is not None]
        if edges:
            kept = [g for g in node_grads if g is not None]
            work.groups.append(WeightGroup(edges, kept, cut_params[node]))
    # Roots whose graph never touches the inputs (the first stage, whose input
    # needs no gradient): W runs their whole backward.
    for root, grad in zip(roots, grads):
        node = _node(root)
        if weight_only(node):
            g = grad if grad is not None else torch.ones_like(root)  # None only for a loss tensor
            work.groups.append(WeightGroup([_edge(root)], [g], _params_below([node], by_node, children)))
    return input_grads, work


def _params_below(nodes: list[Node], by_node: dict[Node, torch.Tensor],
                  children: dict[Node, list[Node]]) -> list[torch.Tensor]:
    """Parameters whose AccumulateGrad is reachable from ``nodes``."""
    seen: set[Node] = set()
    found: list[torch.Tensor] = []
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in by_node:
            found.append(by_node[node])
        stack.extend(c for c in children[node] if c not in seen)
    return found


def _shared_between_cuts(cut_params: dict[Node, list[torch.Tensor]]) -> bool:
    seen: set[int] = set()
    for params in cut_params.values():
        for p in params:
            if id(p) in seen:
                return True
            seen.add(id(p))
    return False


def _keeper(captured: dict, node: Node):
    def hook(grad_outputs):
        captured[node] = tuple(grad_outputs)

    return hook


def _input_grads(roots, grads, inputs) -> list[torch.Tensor | None]:
    wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
    out: list[torch.Tensor | None] = [None] * len(inputs)
    if not wanted:
        return out
    got = torch.autograd.grad(
        list(roots),
        [inputs[i] for i in wanted],
        list(grads),
        retain_graph=True,  # W still needs the saved tensors
        allow_unused=True,
    )
    for i, g in zip(wanted, got):
        out[i] = g
    return out


def backward_weight(work: WeightWork) -> None:
    """W: accumulate parameter gradients from the edges I kept.

    One autograd call per group: a single call from all edges would also walk
    the input path between them again (and count lower layers twice).
    ``autograd.backward(inputs=params)`` accumulates each weight gradient into
    ``.grad`` as soon as it is computed, like a plain backward; collecting
    them with ``autograd.grad`` first kept every fresh gradient buffer alive
    to the end of the call and then read it again, which made W on a stage
    of 2048-wide Linears up to twice as slow as the whole B.
    """
    for group in work.groups:
        if group.params:
            torch.autograd.backward(group.edges, group.grads, retain_graph=True, inputs=group.params)
    work.groups.clear()
