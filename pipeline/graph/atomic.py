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

from dataclasses import dataclass

import networkx as nx

from pipeline.partition.common import topo_order


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


class _Groups:
    """Union-find over node names."""

    def __init__(self, nodes) -> None:
        self.parent = {n: n for n in nodes}

    def find(self, n: str) -> str:
        while self.parent[n] != n:
            self.parent[n] = self.parent[self.parent[n]]
            n = self.parent[n]
        return n

    def union(self, a: str, b: str) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        self.parent[rb] = ra
        return True

    def sets(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for n in self.parent:
            out.setdefault(self.find(n), set()).add(n)
        return out


def contract_unsendable(graph: nx.DiGraph) -> Contraction | None:
    """The contracted graph, or None when every node's output can be sent as it is."""
    unsendable = [n for n in graph.nodes if not sends_as_tensor(graph, n) and graph.out_degree(n)]
    if not unsendable:
        return None
    groups = _Groups(graph.nodes)
    for n in unsendable:
        for succ in graph.successors(n):
            groups.union(n, succ)
    changed = True
    while changed:  # convex closure: whatever lies between two members of a unit joins it
        changed = False
        for members in groups.sets().values():
            if len(members) < 2:
                continue
            below = set().union(*(nx.descendants(graph, m) for m in members))
            above = set().union(*(nx.ancestors(graph, m) for m in members))
            for n in (below & above) - members:
                changed |= groups.union(next(iter(members)), n)
    order = topo_order(graph)
    pos = {n: i for i, n in enumerate(order)}
    units = sorted((sorted(ms, key=pos.__getitem__) for ms in groups.sets().values()), key=lambda ms: pos[ms[0]])
    unit_of = {m: ms[0] for ms in units for m in ms}
    q = nx.DiGraph(**graph.graph)
    for ms in units:
        data = [graph.nodes[m] for m in ms]
        params = sorted({p for d in data for p in d.get("params") or []})
        leaving = [m for m in ms if any(unit_of[s] != ms[0] for s in graph.successors(m))]
        q.add_node(
            ms[0],
            forward_s=sum(float(d.get("forward_s", 0.0)) for d in data),
            backward_s=sum(float(d.get("backward_s", 0.0)) for d in data),
            activation_bytes=sum(int(d.get("activation_bytes", 0)) for d in data),
            output_bytes=sum(int(graph.nodes[m].get("output_bytes", 0)) for m in leaving),
            params=params,
            param_bytes=sum(int(d.get("param_bytes", 0)) for d in data),
            order=pos[ms[0]],
        )
    for u, v in graph.edges:
        if unit_of[u] != unit_of[v]:
            q.add_edge(unit_of[u], unit_of[v], bytes=graph.edges[u, v].get("bytes", 0))
    return Contraction(q, {ms[0]: ms for ms in units})
