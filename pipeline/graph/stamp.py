"""A deep stack of alike blocks exported from a shallow cut of the model, its last block repeated.

Why: torch.export of an 80-layer transformers model takes about 8 s here (a tenth of a second per
layer), and planning a 70B job on a cluster traces it once per micro-batch size and tensor-parallel
degree priced. The blocks of such a model are alike, so the model is exported cut to 2 and to 3
blocks (the cut shares the model's own blocks and tensors, `Repeated.cut`) and the graph at full
depth is the depth-2 graph with its last block repeated: the nodes, targets, arguments, shapes and
module paths a whole export gives, the node names given in graph order by fx's own namespace as
export gives them. It is used only where repeating the depth-2 graph to depth 3 gives back the
depth-3 export exactly (`same_graph`); anything else (blocks configured apart, a block reading
one two back, names export gives otherwise) is exported whole, as before.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph_module import _copy_attr

#: what fx's namespace reads as a name's base and counter (`torch.fx.graph._Namespace`)
_SUFFIX = re.compile(r"(.*)_(\d+)$")
_CALLS = ("call_module", "call_function", "call_method")


@dataclass(frozen=True)
class Repeated:
    """Where a model's alike blocks are: `path`, a ModuleList of them, and `cut(model, k)`, a
    context inside which the model's forward runs its first k blocks only."""

    path: str
    cut: Callable[[nn.Module, int], AbstractContextManager[Any]]


class _Unstampable(Exception):
    """The depth-2 graph's blocks are not laid out as a repeat could copy (then: export whole)."""


def stamped_export(module: nn.Module, export: Callable[[nn.Module], tuple[fx.GraphModule, Any]],
                   repeated: Repeated) -> tuple[fx.GraphModule, Any] | None:
    """`export(module)` at the model's full depth made from its exports at depths 2 and 3, or None
    where that would not be the whole export's graph (then the caller exports it whole)."""
    blocks = module.get_submodule(repeated.path)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) < 4 or not alike(blocks):
        return None
    with repeated.cut(module, 2):
        two, spec = export(module)
    with repeated.cut(module, 3):
        three, _ = export(module)
    try:
        if not same_graph(stamp(two, repeated.path, 3, module), three):
            return None
        return stamp(two, repeated.path, len(blocks), module), spec
    except _Unstampable:
        return None


def alike(blocks: Sequence[nn.Module]) -> bool:
    """Whether every block is configured as the others: the class, plain settings (an object by
    identity: one config shared) and tensor shapes of every submodule, its own index aside."""
    first = _signature(blocks[0], 0)
    return all(_signature(block, i) == first for i, block in enumerate(blocks) if i)


#: a setting holding a block's own index (transformers' `layer_idx`)
_INDEX = re.compile(r"(^|_)(idx|index|id)$")


def _signature(block: nn.Module, index: int) -> tuple:
    parts = []
    for name, sub in block.named_modules():
        settings = []
        for key, value in sorted(vars(sub).items()):
            if key.startswith("_") or key == "training" or key.endswith("hooks"):
                continue
            if _INDEX.search(key) and type(value) is int and value == index:
                continue
            plain = value is None or isinstance(value, (int, float, str, bool, tuple, frozenset))
            settings.append((key, value if plain else id(value)))
        tensors = tuple((k, tuple(t.shape), t.dtype) for k, t in [*sub._parameters.items(), *sub._buffers.items()]
                        if t is not None)
        parts.append((name, type(sub), tuple(settings), tensors))
    return tuple(parts)


def _block(node: fx.Node, path: str) -> int | None:
    """The block (index under `path`) a node belongs to: a get_attr of its tensors, or a call made
    inside it (export's `nn_module_stack`)."""
    prefix = path + "."
    if node.op == "get_attr":
        rest = str(node.target)
        return int(rest[len(prefix):].split(".", 1)[0]) if rest.startswith(prefix) else None
    for where, _ in (node.meta.get("nn_module_stack") or {}).values():
        if where.startswith(prefix):
            index = where[len(prefix):].split(".", 1)[0]
            if index.isdigit():
                return int(index)
    return None


def _runs(nodes: list[fx.Node], path: str, block: int) -> tuple[list[fx.Node], list[fx.Node]]:
    """A block's get_attr nodes and its calls, each a contiguous run of the graph (else unstampable)."""
    at = {n: i for i, n in enumerate(nodes)}
    attrs = [n for n in nodes if n.op == "get_attr" and _block(n, path) == block]
    calls = [n for n in nodes if n.op in _CALLS and _block(n, path) == block]
    for run in (attrs, calls):
        if not run or at[run[-1]] - at[run[0]] != len(run) - 1:
            raise _Unstampable(f"block {block}'s nodes are not contiguous")
    return attrs, calls


def _renamer(path: str, old: int, new: int) -> Callable[[str], str]:
    pattern = re.compile(re.escape(f"{path}.{old}") + r"(?=\.|$)")
    return lambda s: pattern.sub(f"{path}.{new}", s)


def _stamped_meta(meta: dict, rename: Callable[[str], str]) -> dict:
    out = copy.copy(meta)
    if "nn_module_stack" in meta:
        out["nn_module_stack"] = {rename(k): (rename(p), cls) for k, (p, cls) in meta["nn_module_stack"].items()}
    return out


def stamp(gm: fx.GraphModule, path: str, depth: int, model: nn.Module) -> fx.GraphModule:
    """`gm` (an export of the model cut to its first k >= 2 blocks under `path`) with its last block
    repeated up to `depth` blocks: each copy reads the copy before it where the last block read
    the one before it, and its own block's tensors (taken from `model`, the whole model)."""
    nodes = list(gm.graph.nodes)
    last = max((b for n in nodes if (b := _block(n, path)) is not None), default=-1)
    if last < 1:
        raise _Unstampable("fewer than two blocks")
    attrs, calls = _runs(nodes, path, last)
    _, before = _runs(nodes, path, last - 1)
    if [(n.op, n.target) for n in before] != [(n.op, n.target) for n in calls]:
        raise _Unstampable("the last two blocks differ")
    if nodes.index(attrs[-1]) > nodes.index(calls[0]):
        raise _Unstampable("the last block's tensors are read before all of them are fetched")
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen  # the inputs and outputs are the cut model's
    env: dict[fx.Node, fx.Node] = {}
    sources: dict[str, nn.Module] = {}  # each get_attr's owner: the cut model's export, or the whole model
    own_attr = {n: i for i, n in enumerate(attrs)}
    own_call = {n: i for i, n in enumerate(calls)}
    prev_call = {n: i for i, n in enumerate(before)}

    def add(n: fx.Node, args: tuple, kwargs: dict, target: Any, meta: dict) -> fx.Node:
        name = n.name if n.op in ("placeholder", "output") else (
            str(target).replace(".", "_") if n.op == "get_attr" else (m.group(1) if (m := _SUFFIX.match(n.name)) else n.name))
        new = graph.create_node(n.op, target, args, kwargs, name, n.type)
        if n.op == "get_attr" and new.name != str(target).replace(".", "_"):
            raise _Unstampable(f"get_attr {target} named {new.name}")
        new.meta = meta
        return new

    for n in nodes:
        if n.op == "get_attr":
            sources[str(n.target)] = gm
        env[n] = add(n, fx.map_arg(n.args, env.__getitem__), fx.map_arg(n.kwargs, env.__getitem__), n.target,
                     copy.copy(n.meta))
        if n is attrs[-1]:
            copies = [env[a] for a in attrs]
            for j in range(last + 1, depth):
                rename = _renamer(path, last, j)
                for a in attrs:
                    target = rename(str(a.target))
                    sources[target] = model
                    copies.append(add(a, (), {}, target, _stamped_meta(a.meta, rename)))
            block_attrs = [copies[i * len(attrs):(i + 1) * len(attrs)] for i in range(depth - last)]
        if n is calls[-1]:
            previous = [env[c] for c in calls]
            for j in range(last + 1, depth):
                rename, mine = _renamer(path, last, j), block_attrs[j - last]
                made: list[fx.Node] = []

                def read(a: fx.Node, mine=mine, made=made, previous=previous) -> fx.Node:
                    if a in own_call:
                        return made[own_call[a]]
                    if a in prev_call:
                        return previous[prev_call[a]]
                    if a in own_attr:
                        return mine[own_attr[a]]
                    if _block(a, path) is not None:
                        raise _Unstampable(f"{a.name} is read from a block further back")
                    return env[a]

                for c in calls:
                    made.append(add(c, fx.map_arg(c.args, read), fx.map_arg(c.kwargs, read), c.target,
                                    _stamped_meta(c.meta, rename)))
                previous = made
            for c, copied in zip(calls, previous, strict=True):  # what follows reads the deepest block
                env[c] = copied
    holder = nn.Module()
    for target, source in sources.items():
        _copy_attr(source, holder, target)
    out = _LazyGraphModule(holder, graph, gm.__class__.__name__)  # its code made if it ever runs
    for key in ("_in_spec", "_out_spec"):
        if hasattr(gm, key):
            setattr(out, key, getattr(gm, key))
    return out


def same_graph(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether two graphs are node for node the same: names, ops, targets, arguments (by name),
    shapes and dtypes, and the module each call was made in."""
    left, right = list(a.graph.nodes), list(b.graph.nodes)
    if len(left) != len(right):
        return False
    return all(_node_key(x) == _node_key(y) for x, y in zip(left, right, strict=True))


def _node_key(n: fx.Node) -> tuple:
    val = n.meta.get("val")
    shape = tuple(getattr(val, "shape", ())) if val is not None else None
    stack = tuple(p for p, _ in (n.meta.get("nn_module_stack") or {}).values())
    return (n.name, n.op, str(n.target), str(fx.map_arg(n.args, lambda x: x.name)),
            str(fx.map_arg(n.kwargs, lambda x: x.name)), shape, str(getattr(val, "dtype", None)), stack)
