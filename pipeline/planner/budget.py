"""The memory budget: what each stage holds under the chosen schedule, and the checks against the cap.

Stages are priced by the micro-batches the schedule keeps in flight on them (`Schedule.peak_in_flight`),
counted on the schedule's unit-cost order before the split exists, then priced again on the final
order; recomputing stages (remat) hold full activations for fewer of them and the inputs of all.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.errors import ConfigError
from pipeline.ir import Schedule
from pipeline.partition import Partition, PartitionRequest, evaluate, min_memory_cap
from pipeline.partition.common import memory_error
from pipeline.schedules import build_schedule
from pipeline.schedules.base import ScheduleGenerator


def partition_request(
    generator: ScheduleGenerator, placement: Sequence[int], microbatches: int, remat: str, cap: float | None,
    bandwidth: float,
) -> PartitionRequest:
    """What a split is priced by for this schedule and `remat`: the in-flight counts of the schedule's
    unit-cost order (the split is cut before measured stage costs can reorder it), and under
    recomputation (remat=full, or remat=auto with a budget) the counts of the recomputing order."""
    placement = list(placement)
    plain = build_schedule(generator, placement, microbatches).peak_in_flight()
    if not generator.training or remat == "none" or (remat == "auto" and cap is None):
        return PartitionRequest(bandwidth, plain, cap)
    recomputed = build_schedule(generator, placement, microbatches, "full").peak_in_flight()
    return PartitionRequest(bandwidth, plain, cap, recomputed, remat_all=remat == "full")


def reprice_split(part: Partition, graph, **price) -> Partition:
    """The same assignment priced again by `evaluate` with these terms; method and solver facts are kept."""
    out = evaluate(graph, part.assignment, part.num_stages, method=part.method, **price)
    out.info = dict(part.info)
    return out


def check_memory(part: Partition, graph, num_stages: int, request: PartitionRequest, name: str) -> None:
    """A fixed split (uniform, manual) over the budget: name the stage, and the smallest budget a
    contiguous split can meet (balanced/milp search within the budget themselves)."""
    cap = request.memory_cap
    if cap is None or max(part.stage_memory_bytes) <= cap:
        return
    worst = max(range(num_stages), key=lambda s: part.stage_memory_bytes[s])
    smallest = min_memory_cap(graph, num_stages, request.in_flight, remat_in_flight=request.remat_in_flight,
                              remat_all=request.remat_all)
    detail = (f"partitioner={name} puts {part.stage_memory_bytes[worst] / 2**20:.1f} MiB on stage {worst}"
              f" (parameters + activations of its in-flight micro-batches).")
    if smallest > cap:
        raise memory_error(smallest, cap, detail, recomputing=request.remat_in_flight is not None)
    raise ConfigError(
        "memory.cap_bytes",
        f"{int(cap)} bytes per stage is exceeded: {detail} A split within it exists (the smallest cap any "
        f"split meets is {int(smallest)} bytes): use partitioner=balanced or partitioner=milp.",
    )


def check_schedule_memory(part: Partition, schedule: Schedule, cap: float | None) -> None:
    """Re-price each stage with the final schedule's counts and record them; over the budget is an
    error. The split was cut for the schedule's unit-cost order; a cost-aware order (zbv, zb_h2,
    hanayo on a measured profile) may hold its micro-batches on other stages."""
    held, full = schedule.peak_in_flight(held=True), schedule.peak_in_flight()
    part.reprice(held, full, schedule.remat_stages())
    if cap is None or max(part.stage_memory_bytes) <= cap:
        return
    worst = max(range(len(held)), key=lambda s: part.stage_memory_bytes[s])
    raise ConfigError(
        "memory.cap_bytes",
        f"{int(cap)} bytes per stage is exceeded: scheduler {schedule.name!r} holds {held[worst]} micro-batches "
        f"on stage {worst}, {full[worst]} of them with full activations ({int(part.stage_memory_bytes[worst])} bytes "
        f"with its parameters). Raise the cap; for a scheduler that orders its actions on the measured costs "
        f"(zbv, zb_h2, hanayo), scheduler.cost_aware=false keeps the unit-cost order the split was cut for.",
    )
