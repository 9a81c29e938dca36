"""Keep values that cannot travel between ranks inside one stage.

Why: a graph traced down to single operators has nodes whose output is not one tensor: shape
integers (`b, t, d = x.shape`), tuples from `chunk`/`unbind` before their `getitem`s. P2P sends
tensors, so no stage boundary may fall on an edge out of such a node. Rather than teach every
partitioner that rule, the cost graph is contracted first: each such node joins its consumers in
one unit, together with every node on a path between them (so the contracted graph stays acyclic).
Partitioners cut the contracted graph; the assignment is expanded back to the original nodes and
priced on the original graph.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import networkx as nx
from networkx.utils import UnionFind

from pipelaunch.pipeline.graph.derived import sent_bytes
from pipelaunch.pipeline.planner.partition.common import topo_order


def sends_as_tensor(graph: nx.DiGraph, node: str) -> bool:
    """True when the node's output is one tensor (tracing records `single_tensor`; absent = yes)."""
    return bool(graph.nodes[node].get("single_tensor", True))


@dataclass
class Contraction:
    """The contracted graph and, for each of its nodes, the original nodes it stands for."""

    graph: nx.DiGraph
    members: dict[str, list[str]]

    def expand(self, assignment: dict[str, int]) -> dict[str, int]:
        return {m: stage for unit, stage in assignment.items() for m in self.members[unit]}


def contract_unsendable(graph: nx.DiGraph) -> Contraction | None:
    """The contracted graph, or None when every node's output can be sent as it is and no leaf
    module spans several nodes. Nodes of one leaf module (an export trace's ops of one decoder
    layer) form one unit too."""
    unsendable = [n for n in graph.nodes if not sends_as_tensor(graph, n) and graph.out_degree(n)]
    by_leaf: dict[str, list[str]] = {}
    for n in graph.nodes:
        if graph.nodes[n].get("leaf"):
            by_leaf.setdefault(graph.nodes[n]["leaf"], []).append(n)
    split_leaves = [ms for ms in by_leaf.values() if len(ms) > 1]
    if not unsendable and not split_leaves:
        return None
    units, pos = _units(graph, unsendable, split_leaves)
    unit_of = {m: ms[0] for ms in units for m in ms}
    data_of = dict(graph.nodes(data=True))
    leaving: set[str] = set()  # nodes with a consumer in another unit
    between: list[tuple[str, str, int]] = []
    for u, v, d in graph.edges(data=True):
        if unit_of[u] != unit_of[v]:
            leaving.add(u)
            between.append((unit_of[u], unit_of[v], d.get("bytes", 0)))
    q = nx.DiGraph(**graph.graph)
    for ms in units:
        data = [data_of[m] for m in ms]
        params = sorted({p for d in data for p in d.get("params") or []})
        q.add_node(
            ms[0],
            forward_s=sum(float(d.get("forward_s", 0.0)) for d in data),
            backward_s=sum(float(d.get("backward_s", 0.0)) for d in data),
            activation_bytes=sum(int(d.get("activation_bytes", 0)) for d in data),
            stash_bytes=sum(int(d.get("stash_bytes", 0)) for d in data),
            loss_activation_bytes=sum(int(d.get("loss_activation_bytes", 0)) for d in data),
            output_bytes=sum(sent_bytes(data_of[m]) for m in ms if m in leaving),
            params=params,
            param_bytes=sum(int(d.get("param_bytes", 0)) for d in data),
            order=pos[ms[0]],
        )
    for u, v, nbytes in between:
        q.add_edge(u, v, bytes=nbytes)
    return Contraction(q, {ms[0]: ms for ms in units})


#: per graph, the units last found and what they were found from (a search cuts one traced graph
#: a hundred times: the closure took 0.1 s a cut on an 80-layer model traced to its operators)
_UNITS: weakref.WeakKeyDictionary[nx.DiGraph, tuple[tuple, list[list[str]], dict[str, int]]] = \
    weakref.WeakKeyDictionary()


def _units(graph: nx.DiGraph, unsendable: list[str], split_leaves: list[list[str]]
           ) -> tuple[list[list[str]], dict[str, int]]:
    """The units (each a node list in program order, the units in the order of their first
    node) and every node's place in program order. Found again whenever what they are found from
    changed (the nodes, their `order`, the edges, which nodes are unsendable, which leaf each
    belongs to)."""
    key = (tuple(graph.nodes), tuple(graph.nodes[n].get("order") for n in graph.nodes), tuple(graph.edges),
           tuple(unsendable), tuple(map(tuple, split_leaves)))
    known = _UNITS.get(graph)
    if known is not None and known[0] == key:
        return [list(ms) for ms in known[1]], dict(known[2])
    groups = UnionFind(graph.nodes)
    for n in unsendable:
        groups.union(n, *graph.successors(n))
    for members in split_leaves:
        groups.union(*members)
    order = topo_order(graph)
    pos = {n: i for i, n in enumerate(order)}
    changed = True
    while changed:  # convex closure: whatever lies between two members of a unit joins it
        changed = False
        for members in list(groups.to_sets()):
            if len(members) < 2:
                continue
            first, last = min(pos[m] for m in members), max(pos[m] for m in members)
            # only nodes ordered between the unit's first and last member can lie between two
            # members: one walk each way from all of them, bounded by that span (a walk per member
            # over the whole graph took a minute on an 80-layer model traced to its operators)
            below = _reach(graph.successors, members, lambda n, last=last: pos[n] <= last)
            above = _reach(graph.predecessors, members, lambda n, first=first: pos[n] >= first)
            between = (below & above) - members
            if between:
                groups.union(next(iter(members)), *between)
                changed = True
    units = sorted((sorted(ms, key=pos.__getitem__) for ms in groups.to_sets()), key=lambda ms: pos[ms[0]])
    _UNITS[graph] = (key, [list(ms) for ms in units], dict(pos))
    return units, pos


def _reach(step, sources: set[str], within) -> set[str]:
    """The nodes reachable from `sources` by `step` (successors or predecessors) through nodes
    `within` admits."""
    seen: set[str] = set()
    todo = list(sources)
    while todo:
        for nxt in step(todo.pop()):
            if nxt not in seen and within(nxt):
                seen.add(nxt)
                todo.append(nxt)
    return seen
