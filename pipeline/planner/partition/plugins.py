"""The partitioners as `conf/partitioner/*.yaml` name them: one signature for all.

    partitioner(graph, num_stages, request, **options) -> Partition

`graph` is the traced cost graph (nodes carry forward_s, backward_s, activation_bytes,
output_bytes, params; edges carry bytes; see `pipelaunch.pipeline.planner.partition.common`), `request` says what the
split is priced by (`PartitionRequest`: link bandwidth, the schedule's in-flight micro-batches per
stage, the memory cap, recomputation), and `options` are the YAML's own keys (everything but
the function's import path and `name`), bound by the launcher. A function that reads no measured
costs sets `needs_profile = False`, so the launcher need not profile the model for it; one whose
split on a chain of blocks is another's sets `same_split_on_a_chain` to that one, so a search
comparing both leaves it out there; one that cannot choose what remat=auto recomputes under a
memory budget sets `chooses_remat = False`, so a screened search (search/screen.py) does not plan
those candidates to learn it; one whose split takes seconds names a quicker one the screen's
estimates cut by instead (`estimated_as`). The planner prices whatever a partitioner returns once more with
the one judge, `evaluate`, so partitioners only have to choose the assignment.

A user's partitioner is one such function in their own package plus one YAML file in their own
config directory (Hydra's search path): see docs/design.md, "adding a schedule, a partitioner, a
model".
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.planner.partition.balanced import balanced
from pipelaunch.pipeline.planner.partition.common import (
    Partition,
    PartitionRequest,
    assignment_from_order,
    evaluate,
    topo_order,
)
from pipelaunch.pipeline.planner.partition.manual import manual
from pipelaunch.pipeline.planner.partition.milp import milp_partition
from pipelaunch.pipeline.planner.partition.uniform import layer_starts, uniform


def uniform_split(graph: nx.DiGraph, num_stages: int, request: PartitionRequest) -> Partition:
    """Equal numbers of layers per stage. On an operator-level trace of a layer list (a transformers
    model's decoder layers): whole layers, the counts differing by at most one, the embedding with
    the first stage and the final norm and head with the last, not counted as layers
    (`layer_starts`). Otherwise equal numbers of blocks: of the nodes that hold parameters (a
    chain's blocks), the parameter-free ops in between riding with the block after them; counting
    every node instead would give whole stages to the mask and position ops of an operator-level
    trace. A graph with fewer layers than stages is cut that way too, and one with fewer parameter
    nodes than stages by node count."""
    order = topo_order(graph)
    starts = layer_starts(graph, order, num_stages)
    if starts is None:
        holders = [i for i, n in enumerate(order)
                   if graph.nodes[n].get("param_bytes") or graph.nodes[n].get("params")]
        if len(holders) < num_stages:
            return uniform(graph, num_stages, request.bandwidth, request.in_flight)
        base, extra = divmod(len(holders), num_stages)
        starts, at = [0], 0
        for s in range(num_stages - 1):
            at += base + (1 if s < extra else 0)
            starts.append(holders[at])
    return evaluate(graph, assignment_from_order(order, starts), num_stages, request.bandwidth, request.in_flight,
                    "uniform")


uniform_split.needs_profile = False  # type: ignore[attr-defined]


def manual_split(
    graph: nx.DiGraph, num_stages: int, request: PartitionRequest, split_points: Sequence[str] = ()
) -> Partition:
    """Stage s+1 starts at split_points[s] (a node or a module's qualified name)."""
    return manual(graph, num_stages, list(split_points or []), request.bandwidth, request.in_flight)


manual_split.needs_profile = False  # type: ignore[attr-defined]


def balanced_split(graph: nx.DiGraph, num_stages: int, request: PartitionRequest) -> Partition:
    """The contiguous split with the smallest bottleneck, within the memory cap, choosing which
    stages recompute under remat=auto (exact dynamic program)."""
    return balanced(graph, num_stages, request.bandwidth, request.memory_cap, request.in_flight,
                    remat_in_flight=request.remat_in_flight, remat_all=request.remat_all)


def milp_split(
    graph: nx.DiGraph, num_stages: int, request: PartitionRequest, time_limit_s: float = 5.0
) -> Partition:
    """Any valid DAG split (scipy milp / HiGHS). It prices activations only: under remat=full it cuts
    on the recomputed counts (the planner re-prices in full); remat=auto it cannot model: refused."""
    in_flight = request.in_flight
    if request.remat_in_flight is not None:
        if not request.remat_all:
            raise ConfigError(
                "remat",
                "remat=auto with a memory budget chooses the stages to recompute while cutting, which "
                "partitioner=balanced, uniform and manual do and partitioner=milp does not; use one of "
                "those, or remat=full / remat=none with milp.",
            )
        in_flight = request.remat_in_flight
    return milp_partition(graph, num_stages, request.bandwidth, request.memory_cap, in_flight,
                          time_limit=float(time_limit_s))


# on a chain of blocks the contiguous optimum is balanced's: the same split, found slower
milp_split.same_split_on_a_chain = balanced_split  # type: ignore[attr-defined]
milp_split.chooses_remat = False  # type: ignore[attr-defined]
# a screened search estimates its split by balanced's (its own search takes up to its time limit)
milp_split.estimated_as = balanced_split  # type: ignore[attr-defined]
