"""Per-layer recomputation: chosen leaf modules of a stage run under activation checkpointing.

Why rewrite the graph instead of wrapping the submodules: parameter names are the key of
checkpoints, DP and tied-weight sync and initialisation (`gm.named_parameters()`), and a wrapper
module would add a level to every name inside it. Turning `call_module` into a `call_function` of
`checkpointed(submodule, ...)` leaves the module tree, hence every name, as it was.

Non-reentrant checkpoint keeps only the module's inputs; the first unpack of a saved tensor in an
autograd graph task runs the module's forward again (same RNG state, same autocast). A fused
backward recomputes once; a split one (I, then W) once in I and once in W
(`pipelaunch.pipeline.compute.backward` runs all of W's restarts as one group, so not once per restart).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import fx, nn
from torch.utils.checkpoint import checkpoint


def _call(module: nn.Module, kwargs: dict[str, Any], *args: Any) -> Any:
    return module(*args, **kwargs)


def checkpointed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`module(*args, **kwargs)`, its activations recomputed in the backward. The keyword arguments
    travel as one positional dict, so none can clash with checkpoint's own options."""
    return checkpoint(_call, module, kwargs, *args, use_reentrant=False)


def recompute_modules(gm: fx.GraphModule, nodes: Iterable[str]) -> None:
    """Make the named call_module nodes of `gm` checkpointed, in place; names stay as they are.

    Raises ValueError naming every node that is not a call_module node of this graph."""
    wanted = list(dict.fromkeys(nodes))
    if not wanted:
        return
    by_name = {n.name: n for n in gm.graph.nodes}
    bad = [name for name in wanted if name not in by_name or by_name[name].op != "call_module"]
    if bad:
        raise ValueError(f"cannot recompute {bad}: not call_module (leaf module) nodes of this stage; "
                         f"candidates: {sorted(n.name for n in gm.graph.nodes if n.op == 'call_module')}")
    for name in wanted:
        node = by_name[name]
        with gm.graph.inserting_before(node):
            module = gm.graph.get_attr(node.target)
        node.op, node.target, node.args = "call_function", checkpointed, (module, *node.args)
    gm.recompile()
