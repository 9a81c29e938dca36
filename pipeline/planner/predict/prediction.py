"""Predict a run before it starts: simulate the plan on its profile and price each device's memory.

`mode=plan` prints this prediction without starting any rank; `plan=auto` and `scheduler=auto`
(`pipelaunch.pipeline.planner.search.choose`) rank their candidates by it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.core.plan_records import UnitCost
from pipelaunch.pipeline.planner.predict.costs import cost_model_from_plan
from pipelaunch.pipeline.planner.predict.data_parallel import (
    Collectives,
    DataParallelStep,
    Sharded,
    data_parallel_step,
    whole_stages,
)
from pipelaunch.pipeline.planner.predict.memory import (
    DeviceMemory,
    Sharding,
    UpdateMemory,
    device_memory,
    rank_param_bytes,
)
from pipelaunch.pipeline.planner.predict.shared_cores import shared_makespan
from pipelaunch.pipeline.planner.predict.simulate import CostModel, SimResult, compute_spans, simulate


@dataclass
class Prediction:
    plan: Plan
    cost: CostModel
    result: SimResult
    #: each pipeline rank's predicted peak (parameters, gradients, optimizer state, activations)
    devices: list[DeviceMemory] = field(default_factory=list)
    #: the schedule's time once ranks sharing too few cores are accounted for (>= the makespan)
    schedule_s: float = 0.0
    #: each pipeline rank's optimizer step after the schedule
    optimizer_s: list[float] = field(default_factory=list)
    #: each pipeline rank's time past the schedule's end spent on data-parallel collectives (its
    #: gathers' delay and the reductions still running after its last compute; dp > 1)
    data_parallel_s: list[float] = field(default_factory=list)
    #: the replicas' collectives as timeline events (their own `dp` lane per rank; dp > 1)
    collective_events: list[dict] = field(default_factory=list)

    #: per rank, each compute action's (start, end) once the gathers' delays are in (dp > 1)
    collective_spans: list[list[tuple[float, float]]] = field(default_factory=list)

    def timeline_events(self) -> list[dict]:
        """The simulated step as the timeline draws it: each compute action where the gathers it
        waits for put it, and the collectives on their ranks' own lanes."""
        events = self.result.events
        if not self.collective_spans:
            return list(events)
        order: dict[int, int] = {}
        moved = []
        for e in sorted(events, key=lambda e: (e["rank"], e["start_s"])):
            i = order[e["rank"]] = order.get(e["rank"], -1) + 1
            start, end = self.collective_spans[e["rank"]][i]
            moved.append({**e, "start_s": start, "end_s": end})
        return moved + self.collective_events

    @property
    def step_s(self) -> float:
        """A training step: the schedule, then the slowest rank's collectives and optimizer step."""
        extra = [o + (self.data_parallel_s[r] if self.data_parallel_s else 0.0) for r, o in enumerate(self.optimizer_s)]
        return self.schedule_s + max(extra, default=0.0)

    @property
    def peak_bytes(self) -> float:
        """The fullest device's predicted peak."""
        return max((d.total for d in self.devices), default=0.0)


@contextmanager
def profiling_threads(threads: int) -> Iterator[None]:
    """Profile at the thread count each rank will train with, then restore the launcher's."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def predict(plan: Plan, latency_s: float, bandwidth: float, collectives: bool = True) -> Prediction:
    """Simulate a profiled plan's schedule on its per-stage costs, and price each device's memory
    at the simulated peak (the planner records the winner's in `plan.meta.device_memory`).
    Without `collectives` the replicas' collectives are left out (`with_collectives` adds them):
    for the memory fit's trials, whose peaks do not depend on them."""
    cost = cost_model_from_plan(plan, latency_s, bandwidth)
    result = simulate(plan.schedule, cost)
    machine = plan.meta.machine
    devices = device_memory(plan.meta.partition.stage_param_bytes, plan.schedule.placement, result.peak_activation_bytes,
                            int(plan.meta.optimizer_states), plan.meta.stage_recompute_region_bytes,
                            plan.meta.stage_workspace_bytes, float(plan.meta.reserve_bytes or 0.0),
                            update=UpdateMemory(plan.meta.stage_largest_param_bytes,
                                                tuple(machine.optimizer_temporaries), grad_replicas(plan)),
                            sharding=plan_sharding(plan), replicated_bytes=_sharded_and_tied(plan)[1],
                            units=stage_unit_bytes(plan), expert_bytes=_experts(plan),
                            expert_replicas=grad_replicas(plan) // max(1, plan.ep))
    schedule_s = result.makespan_s
    slots = machine.rank_slots
    if slots:  # more local ranks than cores: busy ranks share them (pipeline/planner/predict/shared_cores.py)
        schedule_s = shared_makespan(plan.schedule, cost, slots, grad_replicas(plan))
    per_byte = float(machine.optimizer_s_per_byte or 0.0)
    sharded, tied = _sharded_and_tied(plan)
    degree = (plan.meta.dp_shard or grad_replicas(plan)) if plan.meta.zero else 1  # a replica steps its shard
    # ... and of its experts the shard over their dp / ep expert replicas (whole at ep = dp)
    expert_degree = grad_replicas(plan) // max(1, plan.ep) if plan.meta.zero else 1
    placement = plan.schedule.placement
    optimizer = [(s / degree + t + e / expert_degree) * per_byte
                 for s, t, e in zip(rank_param_bytes(sharded, placement), rank_param_bytes(tied, placement),
                                    rank_param_bytes(_experts(plan), placement), strict=True)]
    prediction = Prediction(plan, cost, result, devices, schedule_s, optimizer)
    return with_collectives(prediction) if collectives else prediction


def with_collectives(prediction: Prediction) -> Prediction:
    """The prediction with the replicas' collectives priced on its simulated compute."""
    plan, cost, result = prediction.plan, prediction.cost, prediction.result
    step = data_parallel_collectives(plan, cost, result.compute_spans)
    return replace(prediction, data_parallel_s=data_parallel_seconds(plan, cost, result.makespan_s,
                                                                     spans=result.compute_spans, step=step),
                   collective_events=step.events if step is not None else [],
                   collective_spans=step.spans if step is not None else [])


def grad_replicas(plan: Plan) -> int:
    """The ranks a parameter's gradient is summed (and, under zero, sharded) over: the dp replicas
    and their cp ranks, each of which computed its positions' share (`RankMesh.grad_mesh`)."""
    return plan.dp * max(1, plan.cp)


def plan_sharding(plan: Plan) -> Sharding:
    """The plan's sharding as the memory model prices it."""
    meta = plan.meta
    return Sharding(meta.zero, meta.dp_shard or grad_replicas(plan), meta.precision, meta.reshard,
                    keeps_reduce_input=meta.device_type != "cpu")


def stage_unit_bytes(plan: Plan) -> list[tuple[list[float], float]]:
    """Per stage, its units' parameter bytes and its root unit's (`plan_units`)."""
    return [([u.param_bytes for u in units if u.name != "root"],
             sum(u.param_bytes for u in units if u.name == "root")) for units in plan_units(plan)]


def _sharded_and_tied(plan: Plan) -> tuple[list[float], list[float]]:
    """Per stage: parameter bytes the replicas shard or reduce as a stage, and tied bytes (kept
    whole, all-reduced after the step); an ep rank's experts are in neither (`_experts`)."""
    whole = [float(b) for b in plan.meta.partition.stage_param_bytes]
    tied = [float(b) for b in (plan.meta.stage_replicated_param_bytes or [0.0] * len(whole))]
    experts = _experts(plan)
    return [max(0.0, w - t - e) for w, t, e in zip(whole, tied, experts, strict=True)], tied


def _experts(plan: Plan) -> list[float]:
    """Per stage, its share of the routed experts' bytes under ep > 1 (0 without)."""
    n = len(plan.meta.partition.stage_param_bytes)
    return [float(b) for b in (plan.meta.stage_expert_param_bytes or [0.0] * n)]


def plan_units(plan: Plan) -> list[list[UnitCost]]:
    """Per stage, its units as the runtime moves them (the plan's, else the stage as one unit of its
    sharded bytes); tied parameters are in none."""
    if plan.meta.stage_units is not None:
        return [list(units) for units in plan.meta.stage_units]
    return whole_stages(_sharded_and_tied(plan)[0])


def data_parallel_collectives(plan: Plan, cost: CostModel, spans: list[list[tuple[float, float]]] | None = None,
                              flat: bool = False) -> DataParallelStep | None:
    """The replicas' collectives of the plan priced on its simulated compute (predict/data_parallel.py),
    None without replicas; `spans`: the compute's start and end times when a simulation of this
    plan already has them; `flat`: as if every reduction started after the rank's last compute."""
    if grad_replicas(plan) < 2 or not plan.schedule.training:
        return None
    spans = compute_spans(plan.schedule, cost) if spans is None else spans
    own = plan.meta.machine.dp_link  # a hardware file's: the replicas' own link class
    links = Collectives(grad_replicas(plan), *(own if own else (cost.latency_s, cost.bandwidth_bytes_per_s)), plan.meta.dp_shard)
    sharded = Sharded(plan.meta.zero, plan_units(plan), plan.meta.reshard, plan_sharding(plan).compute_bytes)
    return data_parallel_step(plan.schedule, spans, sharded, _sharded_and_tied(plan)[1], links, flat=flat,
                              expert_bytes=_experts(plan), expert_replicas=grad_replicas(plan) // max(1, plan.ep))


def data_parallel_seconds(plan: Plan, cost: CostModel, makespan_s: float, flat: bool = False,
                          spans: list[list[tuple[float, float]]] | None = None,
                          step: DataParallelStep | None = None) -> list[float]:
    """Per pipeline rank, the time its data-parallel collectives add past the schedule's end
    (`data_parallel_collectives`, or `step` when priced already)."""
    step = step if step is not None else data_parallel_collectives(plan, cost, spans, flat)
    if step is None:
        return []
    spans = spans if spans is not None else compute_spans(plan.schedule, cost)
    return [max(0.0, (e[-1][1] if e else 0.0) + g + t - makespan_s)
            for e, g, t in zip(spans, step.gather_s, step.tail_s, strict=True)]
