"""What makes a node -> stage assignment valid: shared by the partitioners (planning) and the stage
splitter (which a rank runs), so it lives apart from both."""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx


def validate_assignment(graph: nx.DiGraph, assignment: Mapping[str, int], num_stages: int) -> None:
    """Raise ValueError unless every node is in a stage 0..k-1, no stage is empty, and no edge goes back."""
    missing = [n for n in graph.nodes if n not in assignment]
    if missing:
        raise ValueError(f"assignment misses {len(missing)} node(s), e.g. {missing[:5]}")
    bad = {n: s for n, s in assignment.items() if not 0 <= s < num_stages}
    if bad:
        raise ValueError(f"stage indices outside 0..{num_stages - 1}: {dict(list(bad.items())[:5])}")
    used = set(assignment.values())
    if len(used) != num_stages:
        raise ValueError(f"stages {sorted(set(range(num_stages)) - used)} are empty")
    back = [(u, v) for u, v in graph.edges if assignment[u] > assignment[v]]
    if back:
        u, v = back[0]
        raise ValueError(f"edge {u} -> {v} goes from stage {assignment[u]} back to stage {assignment[v]}")
