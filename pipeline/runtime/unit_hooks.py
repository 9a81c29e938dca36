"""Where a stage's units begin and end, seen from inside its forward and backward.

A stage runs as one fx graph per micro-batch, so its blocks (units: pipeline/graph/units.py) have no
module call of their own to hook: an export-traced model reads its weights by `get_attr`, and even a
chain of blocks hands a block's output straight to the next. `install` rewrites the stage's graph
instead: before the first node of a unit's span an `enter` node, after its last an `exit` node.

- forward: `enter` tells the stage's driver the unit is about to run (gather it, prefetch the
  next), `exit` that it has run (release it);
- backward: the values entering a unit pass through one autograd Function whose backward runs
  once the unit's backward is done (its input gradients computed, and in a full backward its
  weight gradients accumulated: autograd's CPU and per-device queues run a node's AccumulateGrad,
  whose priority is the highest, before the nodes it readied, as FSDP2's post-backward hook relies
  on); the values leaving it carry a tensor hook that runs when the first gradient reaches the
  unit, before its backward starts (gather it, prefetch the one before).

A unit none of whose entering values needs a gradient (an embedding reading token ids) has no
post-backward hook: the driver finishes it after the action (`Driver` in runtime/sharding.py).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

import torch
from torch import fx
from torch.utils import _pytree as pytree

from pipelaunch.pipeline.graph.units import StageUnits

#: the GraphModule attribute the inserted nodes read the driver from
HOOKS_ATTR = "_unit_hooks"


class UnitHooks(Protocol):
    """What a stage's driver does at each unit boundary (unit: index into `StageUnits.units`)."""

    def forward_begin(self, unit: int) -> None: ...

    def forward_end(self, unit: int) -> None: ...

    def backward_begin(self, unit: int) -> None: ...

    def backward_end(self, unit: int) -> None: ...


class _Enter(torch.autograd.Function):
    """Identity on a unit's entering values; its backward is the unit's post-backward."""

    @staticmethod
    def forward(ctx: Any, hooks: UnitHooks, unit: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hooks, ctx.unit = hooks, unit
        return xs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.hooks.backward_end(ctx.unit)
        return (None, None, *grads)


def unit_enter(hooks: UnitHooks, unit: int, *values: Any) -> tuple:
    """The unit is about to run: its driver's forward hook, and the values that need a gradient
    routed through `_Enter` (others as they are)."""
    hooks.forward_begin(unit)
    grad = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.requires_grad]
    if not grad or not torch.is_grad_enabled():
        return values
    routed = _Enter.apply(hooks, unit, *(values[i] for i in grad))
    out = list(values)
    for i, v in zip(grad, routed, strict=True):
        out[i] = v
    return tuple(out)


def _pre_backward(hooks: UnitHooks, unit: int, grad: torch.Tensor) -> None:
    hooks.backward_begin(unit)


def unit_exit(hooks: UnitHooks, unit: int, *values: Any) -> None:
    """The unit has run: its driver's forward hook, and a pre-backward hook on every value it hands
    on that needs a gradient."""
    hooks.forward_end(unit)
    if not torch.is_grad_enabled():
        return
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(partial(_pre_backward, hooks, unit))


def install(gm: fx.GraphModule, units: StageUnits, hooks: UnitHooks) -> None:
    """Rewrite `gm` in place: an enter and an exit node around each unit's span (`Unit.first` ..
    `Unit.last`, positions among `gm.graph.nodes` as `graph.units.node_param_uses` numbered them).
    The nodes read `hooks` from the module (`HOOKS_ATTR`); parameter names are untouched."""
    setattr(gm, HOOKS_ATTR, hooks)
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1] if placeholders else nodes[0]), warnings.catch_warnings():
        # the driver is a plain attribute (no module, parameter or buffer): fx warns, and reads it
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        source = gm.graph.get_attr(HOOKS_ATTR)
    for index, unit in enumerate(units.units):
        span = nodes[unit.first:unit.last + 1]
        entering = _entering(span, position, unit.first)
        leaving = [n for n in span if n.op != "get_attr" and any(position.get(u, len(nodes)) > unit.last for u in n.users)]
        with gm.graph.inserting_before(span[0]):
            enter = gm.graph.call_function(unit_enter, (source, index, *entering))
            routed = [gm.graph.call_function(operator.getitem, (enter, i)) for i in range(len(entering))]
        inside = set(span)
        for value, new in zip(entering, routed, strict=True):
            value.replace_all_uses_with(new, delete_user_cb=inside.__contains__)
        with gm.graph.inserting_after(span[-1]):
            gm.graph.call_function(unit_exit, (source, index, *leaving))
    gm.graph.lint()
    gm.recompile()


def _entering(span: Sequence[fx.Node], position: dict[fx.Node, int], first: int) -> list[fx.Node]:
    """The values defined before the span that nodes inside it read (attribute reads are not values)."""
    seen: dict[fx.Node, None] = {}
    for node in span:
        for value in node.all_input_nodes:
            if value.op != "get_attr" and position[value] < first:
                seen.setdefault(value, None)
    return list(seen)
