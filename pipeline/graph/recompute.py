"""Per-block recomputation: chosen blocks of a stage run under activation checkpointing.

A block is the outermost numbered module a node runs inside (`layer3`, `model.model.layers.3`,
`down_blocks.1`: `block_of`), the unit Megatron's full recomputation and torchtitan's activation
checkpointing rerun: a transformer layer. The planner names the blocks to recompute per stage
(`StagePlan.recompute`: whole, `remat=full`; `StagePlan.selective`: under the selective policy,
`pipeline/compute/selective.py`), and the rank turns each block's nodes in its stage's graph into
one call of a checkpointed function (`recompute_blocks`). Whatever the trace: a chain's block is
one call_module node, an export trace's is the dozens of operators of its layer, a cut inside a
layer leaves each stage its own part of it.

Why rewrite the graph instead of wrapping submodules: parameter names are the key of checkpoints,
DP and tied-weight sync and initialisation (`gm.named_parameters()`), and a wrapper module would add
a level to every name inside it. The block's nodes move into a small GraphModule holding no tensor
of its own: every parameter, buffer and submodule it reads stays read by the stage's own `get_attr`
nodes and is passed in, so the values it runs with are the ones the stage holds at that moment
(FSDP2 swaps a block's parameters between their shards and their gathered form).

Non-reentrant checkpoint keeps only the block's inputs (and, selective, the outputs of the
operators the policy keeps); the first unpack of a saved tensor in an autograd graph task reruns
the block (same RNG state, same autocast). A fused backward recomputes once; a split one (I, then
W) once in I and once in W (`pipelaunch.pipeline.compute.backward` runs all of W's restarts as one
group, so not once per restart).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Sequence
from typing import Any

from torch import fx, nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from pipelaunch.pipeline.compute.selective import selective_context

#: a module name numbered in itself (`layer3`, `block12`) or a number (`layers.3`, a Sequential's `0`)
_NUMBERED = re.compile(r"[A-Za-z_]*\d+")
#: the attribute prefix of a stage's recomputed blocks (GraphModules holding no tensor)
REGION_PREFIX = "_recompute_"


def block_path(path: str) -> str | None:
    """A module path up to its outermost numbered component (`model.layers.3.mlp` ->
    `model.layers.3`), or None when no component is numbered (an embedding, a head)."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _NUMBERED.fullmatch(part):
            return ".".join(parts[: i + 1])
    return None


def block_of(node: fx.Node) -> str | None:
    """The block a node computes in: the outermost numbered module of its module stack (for a
    call_module node, its module too), or None."""
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values() if path]
    if node.op == "call_module":
        paths.append(str(node.target))
    for path in paths:
        found = block_path(path)
        if found is not None:
            return found
    return None


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def run_checkpointed(region: fx.GraphModule, selective: bool, *args: Any) -> Any:
    """The block's nodes on `args`, their activations recomputed in the backward (under the
    selective policy the matmuls' outputs kept)."""
    return checkpoint(region, *args, use_reentrant=False,
                      context_fn=selective_context if selective else noop_context_fn)


def block_nodes(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Each block of the graph -> its compute nodes in program order."""
    out: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_function", "call_method"):
            key = block_of(node)
            if key is not None:
                out.setdefault(key, []).append(node)
    return out


def _span(gm: fx.GraphModule, key: str, nodes: list[fx.Node]) -> list[fx.Node]:
    """The block's region: its nodes, with the unlabelled compute nodes between them (a
    collective the tp rewrite put inside a layer); refused when another block's node or a node
    the block reads back falls inside (its nodes could not run as one call)."""
    order = list(gm.graph.nodes)
    first, last = order.index(nodes[0]), order.index(nodes[-1])
    span = []
    for node in order[first:last + 1]:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        other = block_of(node)
        if other is not None and other != key:
            raise ValueError(f"cannot recompute block {key!r}: its nodes interleave with block {other!r}'s "
                             f"({node.name}); it is not one region of the stage's graph")
        span.append(node)
    return span


def _extract(gm: fx.GraphModule, key: str, nodes: list[fx.Node], selective: bool) -> None:
    """Replace `nodes` (in program order) with one checkpointed call of a GraphModule running them."""
    inside = set(nodes)
    reads: list[fx.Node] = []
    for node in nodes:
        for i in node.all_input_nodes:
            if i not in inside and i not in reads:
                reads.append(i)
    modules = [n for n in nodes if n.op == "call_module"]
    leaving = [n for n in nodes if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {i: sub.placeholder(f"in_{i.name}") for i in reads}
    held = {m: sub.placeholder(f"module_{m.name}") for m in modules}
    for node in nodes:
        if node.op == "call_module":  # the module comes in, read by the stage: its name stays the stage's
            args = fx.node.map_arg(node.args, lambda x: env[x])
            kwargs = fx.node.map_arg(node.kwargs, lambda x: env[x])
            env[node] = sub.call_function(_call_module, (held[node], *args), kwargs)
            env[node].meta = dict(node.meta)
        else:
            env[node] = sub.node_copy(node, lambda x: env[x])
    sub.output(tuple(env[n] for n in leaving))
    region = fx.GraphModule(nn.Module(), sub, class_name=f"Recompute_{key.replace('.', '_')}")
    attr = REGION_PREFIX + re.sub(r"\W", "_", key)
    gm.add_submodule(attr, region)
    for i in reads:  # a weight read by the block's later nodes is fetched after its first: fetch it first
        if i.op == "get_attr":
            nodes[0].prepend(i)
    with gm.graph.inserting_before(nodes[0]):
        region_node = gm.graph.get_attr(attr)
        module_nodes = [gm.graph.get_attr(m.target) for m in modules]
        call = gm.graph.call_function(run_checkpointed, (region_node, selective, *reads, *module_nodes))
        outs = [gm.graph.call_function(operator.getitem, (call, k)) for k in range(len(leaving))]
    for node, out in zip(leaving, outs, strict=True):
        out.meta = dict(node.meta)
        node.replace_all_uses_with(out, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        gm.graph.erase_node(node)


def recompute_blocks(gm: fx.GraphModule, full: Iterable[str], selective: Iterable[str] = ()) -> None:
    """Run the named blocks of `gm` checkpointed, in place: `full` keep only their inputs,
    `selective` also the outputs of the operators the policy keeps. Parameter names do not change.

    Raises ValueError naming every block that is not one of this stage's, with the candidates."""
    wanted = [(k, False) for k in dict.fromkeys(full)] + [(k, True) for k in dict.fromkeys(selective)]
    if not wanted:
        return
    found = block_nodes(gm)
    bad = [k for k, _ in wanted if k not in found]
    if bad:
        raise ValueError(f"cannot recompute {bad}: not blocks of this stage (a block is the outermost numbered "
                         f"module its nodes run in); candidates: {sorted(found)}")
    for key, policy in wanted:
        _extract(gm, key, _span(gm, key, found[key]), policy)
    gm.graph.lint()
    gm.recompile()


def recomputed_regions(gm: fx.GraphModule) -> Sequence[str]:
    """The blocks of `gm` that run checkpointed (their region attributes)."""
    return [name.removeprefix(REGION_PREFIX) for name, _ in gm.named_children() if name.startswith(REGION_PREFIX)]
