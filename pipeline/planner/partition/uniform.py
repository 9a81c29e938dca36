"""Equal numbers of nodes (or blocks) per stage: the baseline every smarter partitioner must beat."""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from pipeline.planner.partition.common import (
    DEFAULT_BANDWIDTH,
    Partition,
    assignment_from_order,
    check_stages,
    evaluate,
    topo_order,
)


def uniform(
    graph: nx.DiGraph,
    num_stages: int,
    bandwidth: float = DEFAULT_BANDWIDTH,
    in_flight: int | Sequence[int] = 1,
    order: Sequence[str] | None = None,
) -> Partition:
    """Contiguous stages of the topological order; the first `n % k` stages get one extra node."""
    check_stages(graph, num_stages)
    order = list(order) if order is not None else topo_order(graph)
    base, extra = divmod(len(order), num_stages)
    starts, at = [], 0
    for s in range(num_stages):
        starts.append(at)
        at += base + (1 if s < extra else 0)
    return evaluate(graph, assignment_from_order(order, starts), num_stages, bandwidth, in_flight, "uniform")
