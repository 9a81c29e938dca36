"""Split a stage's backward into I (input gradient, now) and W (weight gradient, later).

Zero-bubble schedules need dL/dx of a stage as early as possible, while dL/dW can wait. Running
autograd twice from the stage output would recompute the whole chain of activation gradients in
W. Instead, I runs autograd only towards the stage input and captures, at every graph node on
that path that also feeds a parameter, the gradient arriving there. W then restarts autograd
from exactly those nodes (as `GradientEdge`s) towards the parameters, so each node's input-path
work is done once and only the weight-gradient work is deferred.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge


@dataclass
class WeightGradStash:
    """What W needs: where autograd restarts, with which gradients, towards which parameters."""

    params: list[nn.Parameter]
    #: one restart per branch node: (edges into the node, their gradients, parameters below it)
    restarts: list[tuple[list[GradientEdge], list[torch.Tensor], list[nn.Parameter]]] = field(default_factory=list)
    # Fallback (first stage, or parameters reachable from two branches): backward from the root.
    root: torch.Tensor | None = None
    root_grad: torch.Tensor | None = None


def _children(node) -> list:
    return [child for child, _ in node.next_functions if child is not None]


def _classify(root_fn, x: torch.Tensor, params_by_id: dict[int, nn.Parameter]):
    """Walk the graph once: which nodes lie on a path to x, and which parameters each reaches."""
    on_input: dict = {}
    reach: dict = {}
    stack = [(root_fn, False)]
    while stack:
        node, expanded = stack.pop()
        if not expanded:
            if node in on_input:
                continue
            var = getattr(node, "variable", None)
            if var is not None:  # AccumulateGrad of a leaf tensor
                on_input[node] = var is x
                reach[node] = frozenset({id(var)}) if id(var) in params_by_id else frozenset()
                continue
            on_input[node] = False  # provisional; marks the node as visited
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if c not in on_input)
        else:
            kids = _children(node)
            on_input[node] = any(on_input[c] for c in kids)
            reach[node] = frozenset().union(*(reach[c] for c in kids))
    return on_input, reach


def backward_input(
    root: torch.Tensor, root_grad: torch.Tensor | None, x: torch.Tensor | None, module: nn.Module
) -> tuple[torch.Tensor | None, WeightGradStash]:
    """Compute dL/dx now; return it and the stash for `backward_weight`."""
    params = [p for p in module.parameters() if p.requires_grad]
    if x is None or root.grad_fn is None:
        return None, WeightGradStash(params, root=root, root_grad=root_grad)
    params_by_id = {id(p): p for p in params}
    on_input, reach = _classify(root.grad_fn, x, params_by_id)
    # A branch node lies on the input path and has children that reach parameters off that path:
    # the weight gradient forks from the input gradient there.
    branches: dict = {}
    for node, on in on_input.items():
        if not on or getattr(node, "variable", None) is not None:
            continue
        below = frozenset().union(*(reach[c] for c in _children(node) if not on_input[c]))
        if below:
            branches[node] = below
    all_below = [pid for below in branches.values() for pid in below]
    if len(all_below) != len(set(all_below)) or set(all_below) != set(params_by_id):
        # A parameter reached from two branches (or only through the input path) would be counted
        # twice or missed by per-branch restarts: defer the plain full backward instead.
        (dx,) = torch.autograd.grad(root, x, root_grad, retain_graph=True)
        return dx, WeightGradStash(params, root=root, root_grad=root_grad)
    captured: dict = {}

    def capture(node):
        return lambda grads: captured.__setitem__(node, grads)

    handles = [n.register_prehook(capture(n)) for n in branches]
    try:
        (dx,) = torch.autograd.grad(root, x, root_grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    stash = WeightGradStash(params)
    for node, grads in captured.items():
        edges = [GradientEdge(node, nr) for nr, g in enumerate(grads) if g is not None]
        stash.restarts.append(
            (edges, [g for g in grads if g is not None], [params_by_id[pid] for pid in branches[node]])
        )
    return dx, stash


def _accumulate(params: list[nn.Parameter], grads) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def backward_weight(stash: WeightGradStash) -> None:
    """Accumulate the deferred parameter gradients into `.grad`, then drop the graph."""
    if stash.root is not None:
        if stash.params:
            torch.autograd.backward(stash.root, stash.root_grad, inputs=stash.params)
        return
    for edges, grads, params in stash.restarts:
        _accumulate(params, torch.autograd.grad(edges, params, grads, allow_unused=True))
    stash.restarts.clear()
