"""The memory budget, as the partitioners see it: one stage priced on its own device.

`memory.cap_bytes` caps each device (pipeline rank): parameters, gradients, optimizer state and the
activations all its stages hold at the schedule's peak (`pipelaunch.pipeline.planner.predict.memory`, checked on the
simulated schedule once the split exists). Before that, a partitioner cuts so that each stage
alone fits the device: its parameters count `Sharding.stage_factor` times (the parameter, its
gradient, the optimizer's tensors as the data-parallel sharding level `zero` leaves them, and at
zero=2/3 the stage's unsharded window: `2 + optimizer states` at zero=0; a parameter several nodes
read, which may end up tied between stages and so kept whole, at the larger of that and the
unsharded `2 + optimizer states`), and its activations once per micro-batch the schedule keeps in
flight there (`Schedule.peak_in_flight`, counted on the schedule's unit-cost order before the split
exists); recomputing stages (remat) hold full activations for fewer of them and the inputs of all.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import networkx as nx

from pipelaunch.pipeline.core.ir import Schedule
from pipelaunch.pipeline.planner.partition import Partition, PartitionRequest, evaluate
from pipelaunch.pipeline.planner.predict.memory import Sharding
from pipelaunch.pipeline.planner.schedules import build_schedule
from pipelaunch.pipeline.planner.schedules.base import ScheduleGenerator


def partition_request(
    generator: ScheduleGenerator, placement: Sequence[int], microbatches: int, remat: str, cap: float | None,
    bandwidth: float,
) -> PartitionRequest:
    """What a split is priced by for this schedule and `remat`: the in-flight counts of the schedule's
    unit-cost order (the split is cut before measured stage costs can reorder it), and under
    whole-stage recomputation (remat=stage, or remat=auto with a budget) the counts of the
    recomputing order.
    Without a budget the counts only break ties between equally fast splits, so they are taken on
    the generator's first candidate order instead of the best of them (at pp=64 with 256
    micro-batches, V-Min's candidates took 1.4 s)."""
    counts = _in_flight if _hashable(generator) else _in_flight.__wrapped__
    # without a cap the counts only break ties between splits: the first candidate order will do
    plain = list(counts(generator, tuple(placement), microbatches, "none", cap is None))
    if not generator.training or remat == "none" or (remat == "auto" and cap is None):
        return PartitionRequest(bandwidth, plain, cap)
    if remat in ("full", "selective"):  # per block, inside the backward: the plain order's counts
        return PartitionRequest(bandwidth, plain, cap)
    recomputed = list(counts(generator, tuple(placement), microbatches, "stage", False))
    return PartitionRequest(bandwidth, plain, cap, recomputed, remat_all=remat == "stage")


def _hashable(value: object) -> bool:
    """A frozen generator (the project's are) can key a cache; a user's mutable one is rebuilt each time."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


@lru_cache(maxsize=256)
def _in_flight(generator: ScheduleGenerator, placement: tuple[int, ...], microbatches: int, remat: str,
               first_order: bool) -> tuple[int, ...]:
    """The unit-cost order's in-flight counts, once per schedule shape (remat=auto's fit builds a
    candidate again with other stages recomputing whole: the same counts)."""
    return tuple(build_schedule(generator, list(placement), microbatches, remat,
                                first_order=first_order).peak_in_flight())


def device_view(graph: nx.DiGraph, param_factor: float, shared_factor: float | None = None) -> nx.DiGraph:
    """The cost graph with every parameter byte counted `param_factor` times (the parameter, its
    gradient and the optimizer's state): what a partitioner prices a stage's memory on when the
    cap is a device's; a parameter more than one node reads (maybe tied between stages, which
    sharding leaves whole) `shared_factor` times when given. Times, activations and the graph
    itself are unchanged."""
    readers: dict[str, int] = {}
    for _, data in graph.nodes(data=True):
        for name in data.get("params") or ():
            readers[name] = readers.get(name, 0) + 1
    shared = {name for name, count in readers.items() if count > 1} if shared_factor is not None else set()
    if param_factor == 1 and not shared:
        return graph
    view = graph.copy()
    sizes = graph.graph.get("param_sizes")
    if sizes:
        view.graph["param_sizes"] = {name: size * (shared_factor if name in shared else param_factor)
                                     for name, size in sizes.items()}
    for node, data in view.nodes(data=True):
        if data.get("param_bytes"):
            view.nodes[node]["param_bytes"] = int(graph.nodes[node]["param_bytes"] * param_factor)
    return view


def stage_param_factors(states: int, sharding: Sharding) -> tuple[float, float]:
    """(per parameter byte, per byte of a parameter several nodes read) of a stage alone on its
    device at this sharding level: what `device_view` counts."""
    factor = sharding.stage_factor(states)
    return factor, max(factor, sum(sharding.held(0.0, 1.0, states)))


def reprice_split(part: Partition, graph, **price) -> Partition:
    """The same assignment priced again by `evaluate` with these terms; method and solver facts are kept."""
    out = evaluate(graph, part.assignment, part.num_stages, method=part.method, **price)
    out.info = dict(part.info)
    return out


def reprice_for_schedule(part: Partition, schedule: Schedule) -> None:
    """Re-price each stage with the final schedule's in-flight counts and record them. The split
    was cut for the schedule's unit-cost order; a cost-aware order (zbv, zb_h2, hanayo on a
    measured profile) may hold its micro-batches on other stages. The device check that follows
    plays the final schedule itself."""
    remat = schedule.remat_stages()
    held = schedule.peak_in_flight(held=True)
    part.reprice(held, schedule.peak_in_flight() if remat else held, remat)  # the same count without R
