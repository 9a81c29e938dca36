"""User-chosen split points: the escape hatch for models tracing cannot handle or users know best.

A split point names either a cost-graph node (an fx node name or block name) or a module's qualified
name, in which case the stage starts at the first node that runs inside that module.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.planner.partition.common import (
    DEFAULT_BANDWIDTH,
    Partition,
    assignment_from_order,
    check_stages,
    evaluate,
    topo_order,
)

SPLIT_KEY = "partitioner.split_points"


def _valid_names(graph: nx.DiGraph, order: Sequence[str]) -> list[str]:
    modules: list[str] = []
    for n in order:
        mod = graph.nodes[n].get("module")
        if mod:
            parts = str(mod).split(".")
            modules += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return list(dict.fromkeys([*order, *modules]))


def _shorten(names: list[str], limit: int = 80) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def resolve_split_point(graph: nx.DiGraph, order: Sequence[str], name: str) -> int:
    """Position in `order` where a stage named `name` begins; ConfigError listing valid names if none."""
    pos = {n: i for i, n in enumerate(order)}
    if name in pos:
        return pos[name]
    for i, n in enumerate(order):
        mod = graph.nodes[n].get("module")
        if mod and (mod == name or str(mod).startswith(name + ".")):
            return i
    raise ConfigError(
        SPLIT_KEY,
        f"unknown split point {name!r}; valid names are: {_shorten(_valid_names(graph, order))}",
    )


def manual(
    graph: nx.DiGraph,
    num_stages: int,
    split_points: Sequence[str],
    bandwidth: float = DEFAULT_BANDWIDTH,
    in_flight: int | Sequence[int] = 1,
    order: Sequence[str] | None = None,
) -> Partition:
    """Stage s+1 starts at `split_points[s]`; needs exactly `num_stages - 1` points, in program order."""
    check_stages(graph, num_stages)
    if len(split_points) != num_stages - 1:
        raise ConfigError(
            SPLIT_KEY,
            f"{num_stages} stages need {num_stages - 1} split points, got {len(split_points)}: {list(split_points)}",
        )
    order = list(order) if order is not None else topo_order(graph)
    starts = [0] + [resolve_split_point(graph, order, name) for name in split_points]
    for s in range(1, len(starts)):
        if starts[s] <= starts[s - 1]:
            raise ConfigError(
                SPLIT_KEY,
                f"split point {split_points[s - 1]!r} leaves stage {s - 1} empty: split points must be "
                "distinct, in program order, and not the very first node",
            )
    return evaluate(graph, assignment_from_order(order, starts), num_stages, bandwidth, in_flight, "manual")
