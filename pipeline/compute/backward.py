"""Split a stage's backward into I (input gradient, now) and W (weight gradient, later).

Zero-bubble schedules need dL/dx of a stage as early as possible, while dL/dW can wait. Running
autograd twice from the stage output would recompute the whole chain of activation gradients in
W. Instead, I runs autograd only towards the stage input and captures, at every graph node on
that path that also feeds a parameter, the gradient arriving there. W then restarts autograd
from exactly those nodes (as `GradientEdge`s) towards the parameters, so each node's input-path
work is done once and only the weight-gradient work is deferred.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.utils import checkpoint as _checkpoint


@dataclass
class WeightGradStash:
    """What W needs: where autograd restarts, with which gradients, towards which parameters."""

    params: list[nn.Parameter]
    #: one restart per branch node: (edges into the node, their gradients, parameters below it)
    restarts: list[tuple[list[GradientEdge], list[torch.Tensor], list[nn.Parameter]]] = field(default_factory=list)
    # Fallback (no differentiable stage input, or parameters reachable from two branches):
    # a plain backward from the roots towards the parameters.
    roots: list[torch.Tensor] = field(default_factory=list)
    root_grads: list[torch.Tensor | None] = field(default_factory=list)
    #: outputs that are parameters themselves (no graph between): their gradients, added in W
    direct: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _children(node) -> list:
    return [child for child, _ in node.next_functions if child is not None]


def _classify(root_fns: Sequence, leaf_ids: set[int], params_by_id: dict[int, nn.Parameter]):
    """Walk the graph once: which nodes lie on a path to a stage input, which parameters each reaches."""
    on_input: dict = {}
    reach: dict = {}
    stack = [(fn, False) for fn in root_fns]
    while stack:
        node, expanded = stack.pop()
        if not expanded:
            if node in on_input:
                continue
            var = getattr(node, "variable", None)
            if var is not None:  # AccumulateGrad of a leaf tensor
                on_input[node] = id(var) in leaf_ids
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


def _needs_input_grad(node) -> bool:
    """Nodes that must not run with their input gradient left out, as W would run them.

    torch's CPU group-norm backward on a channels-last input
    (`GroupNormBackwardKernelImplChannelsLastInternal`, its H*W < 2048 branch) writes dX through a
    null pointer when only dgamma/dbeta are requested (output_mask [False, True, True]): SIGSEGV.
    Such an input follows e.g. an attention block whose `transpose(...).reshape(b, c, h, w)` output
    has channels-last strides (diffusers' UNet2DModel mid-block).
    """
    if node.name() != "NativeGroupNormBackward0":
        return False
    x = node._saved_input
    return x.device.type == "cpu" and not x.is_contiguous()


def backward_input(
    roots: Sequence[torch.Tensor],
    root_grads: Sequence[torch.Tensor | None],
    leaves: dict[str, torch.Tensor],
    params: Sequence[nn.Parameter],
) -> tuple[dict[str, torch.Tensor | None], WeightGradStash]:
    """Compute the gradients of the stage inputs now; return them and the stash for W.

    An output may be an input itself, with no graph in between (a `.to()` to the dtype it already
    has returns its argument): its gradient is the input's, as it is in one process."""
    graph = [(r, g) for r, g in zip(roots, root_grads, strict=True) if r.grad_fn is not None]
    grads, stash = _backward_input([r for r, _ in graph], [g for _, g in graph], leaves, params)
    for r, g in zip(roots, root_grads, strict=True):
        if r.grad_fn is not None:
            continue
        name = next((n for n, x in leaves.items() if x is r), None)
        if name is not None:
            grads[name] = g if grads.get(name) is None else grads[name] + g
        else:
            stash.direct.append((r, g))
    return grads, stash


def _backward_input(
    roots: list[torch.Tensor],
    root_grads: list[torch.Tensor | None],
    leaves: dict[str, torch.Tensor],
    params: Sequence[nn.Parameter],
) -> tuple[dict[str, torch.Tensor | None], WeightGradStash]:
    params = list(params)
    roots, root_grads = list(roots), list(root_grads)
    fallback = WeightGradStash(params, roots=roots, root_grads=root_grads)
    if not roots:
        return {}, WeightGradStash(params)
    names = list(leaves)
    xs = [leaves[n] for n in names]
    if not xs:
        return {}, fallback
    params_by_id = {id(p): p for p in params}
    on_input, reach = _classify([r.grad_fn for r in roots], {id(x) for x in xs}, params_by_id)
    # A branch node lies on an input path and has children that reach parameters off that path:
    # the weight gradient forks from the input gradient there.
    branches: dict = {}
    for node, on in on_input.items():
        if not on or getattr(node, "variable", None) is not None:
            continue
        below = frozenset().union(*(reach[c] for c in _children(node) if not on_input[c]))
        if below:
            branches[node] = below
    if any(_needs_input_grad(node) for node in branches):
        # W would rerun such a node for its weights alone: run the whole backward now instead.
        torch.autograd.backward(roots, root_grads)
        return {n: x.grad for n, x in zip(names, xs, strict=True)}, WeightGradStash(params)
    all_below = [pid for below in branches.values() for pid in below]
    reached = set().union(*reach.values()) if reach else set()
    if len(all_below) != len(set(all_below)) or set(all_below) != (reached & set(params_by_id)):
        # A parameter reached from two branches (or only off every input path) would be counted
        # twice or missed by per-branch restarts: defer a plain backward instead.
        grads = torch.autograd.grad(roots, xs, root_grads, retain_graph=True, allow_unused=True)
        return dict(zip(names, grads, strict=True)), fallback
    captured: dict = {}

    def capture(node):
        return lambda grads: captured.__setitem__(node, grads)

    handles = [n.register_prehook(capture(n)) for n in branches]
    try:
        grads = torch.autograd.grad(roots, xs, root_grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    stash = WeightGradStash(params)
    for node, node_grads in captured.items():
        edges = [GradientEdge(node, nr) for nr, g in enumerate(node_grads) if g is not None]
        stash.restarts.append(
            (edges, [g for g in node_grads if g is not None], [params_by_id[pid] for pid in branches[node]])
        )
    return dict(zip(names, grads, strict=True)), stash


def _one_recompute() -> AbstractContextManager:
    """W's restarts are separate backward calls over disjoint parts of the graph: grouped, a
    checkpointed module (`pipelaunch.pipeline.graph.recompute`) reruns its forward once for all of them, not
    once per restart. torch before 2.10 has no such group: there it reruns per restart."""
    group = getattr(_checkpoint, "GraphExecGroup", None)
    return group() if group is not None else nullcontext()


def backward_weight(stash: WeightGradStash,
                    around: Callable[[list[list[nn.Parameter]]], Iterator[None]] | None = None) -> None:
    """Accumulate the deferred parameter gradients into `.grad`, then drop the graph.

    `autograd.backward(..., inputs=params)` lets AccumulateGrad add straight into `.grad` (no
    separate gradient tensors to allocate and add). `around(jobs)`, given the parameters of each
    restart, yields once before each of them and resumes after the last: a sharded stage gathers
    the blocks a restart needs then, and reduces a block after its last restart
    (runtime/stage_driver.py); a plain backward (`roots`) runs without it."""
    with torch.no_grad():
        for p, g in stash.direct:
            p.grad = g.clone() if p.grad is None else p.grad + g
    stash.direct.clear()
    if stash.roots:
        if stash.params:
            torch.autograd.backward(stash.roots, stash.root_grads, inputs=stash.params)
        stash.roots.clear()
        stash.root_grads.clear()
        return
    steps = around([params for _, _, params in stash.restarts]) if around is not None else None
    with _one_recompute():
        for edges, grads, params in stash.restarts:
            if steps is not None:
                next(steps)
            torch.autograd.backward(edges, grads, inputs=params)
    if steps is not None:
        next(steps, None)
    stash.restarts.clear()
