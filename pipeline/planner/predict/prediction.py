"""Predict a run before it starts: simulate the plan on its profile and price each device's memory.

`mode=plan` prints this prediction without starting any rank; `plan=auto` and `scheduler=auto`
(`pipelaunch.pipeline.planner.search.choose`) rank their candidates by it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.planner.predict.costs import cost_model_from_plan
from pipelaunch.pipeline.planner.predict.data_parallel import Collectives, data_parallel_step
from pipelaunch.pipeline.planner.predict.memory import (
    DeviceMemory,
    Sharding,
    UpdateMemory,
    device_memory,
    rank_param_bytes,
)
from pipelaunch.pipeline.planner.predict.shared_cores import shared_makespan
from pipelaunch.pipeline.planner.predict.simulate import CostModel, SimResult, compute_end_times, simulate


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


def predict(plan: Plan, latency_s: float, bandwidth: float) -> Prediction:
    """Simulate a profiled plan's schedule on its per-stage costs, and price each device's memory
    at the simulated peak (the planner records the winner's in `plan.meta.device_memory`)."""
    cost = cost_model_from_plan(plan, latency_s, bandwidth)
    result = simulate(plan.schedule, cost)
    machine = plan.meta.machine
    devices = device_memory(plan.meta.partition.stage_param_bytes, plan.schedule.placement, result.peak_activation_bytes,
                            int(plan.meta.optimizer_states), plan.meta.stage_recompute_region_bytes,
                            plan.meta.stage_workspace_bytes, float(plan.meta.reserve_bytes or 0.0),
                            update=UpdateMemory(plan.meta.stage_largest_param_bytes,
                                                tuple(machine.optimizer_temporaries), plan.dp),
                            sharding=Sharding(plan.meta.zero, plan.meta.dp_shard or plan.dp, plan.meta.precision),
                            replicated_bytes=plan.meta.stage_replicated_param_bytes)
    schedule_s = result.makespan_s
    slots = machine.rank_slots
    if slots:  # more local ranks than cores: busy ranks share them (pipeline/planner/predict/shared_cores.py)
        schedule_s = shared_makespan(plan.schedule, cost, slots, plan.dp)
    per_byte = float(machine.optimizer_s_per_byte or 0.0)
    sharded, tied = _sharded_and_tied(plan)
    degree = (plan.meta.dp_shard or plan.dp) if plan.meta.zero else 1  # a replica steps its shard
    optimizer = [(s / degree + t) * per_byte for s, t in zip(rank_param_bytes(sharded, plan.schedule.placement),
                                                              rank_param_bytes(tied, plan.schedule.placement),
                                                              strict=True)]
    return Prediction(plan, cost, result, devices, schedule_s, optimizer,
                      data_parallel_seconds(plan, cost, result.makespan_s, ends=result.compute_ends))


def _sharded_and_tied(plan: Plan) -> tuple[list[float], list[float]]:
    """Per stage: parameter bytes the replicas shard or reduce as a stage, and tied bytes (kept whole)."""
    whole = [float(b) for b in plan.meta.partition.stage_param_bytes]
    tied = [float(b) for b in (plan.meta.stage_replicated_param_bytes or [0.0] * len(whole))]
    return [max(0.0, w - t) for w, t in zip(whole, tied, strict=True)], tied


def data_parallel_seconds(plan: Plan, cost: CostModel, makespan_s: float, flat: bool = False,
                          ends: list[list[float]] | None = None) -> list[float]:
    """Per pipeline rank, the time its data-parallel collectives add past the schedule's end
    (predict/data_parallel.py); `flat`: as if every reduction started after the rank's last compute;
    `ends`: the compute's end times when a simulation of this plan already has them."""
    if plan.dp < 2 or not plan.schedule.training:
        return []
    ends = compute_end_times(plan.schedule, cost) if ends is None else ends
    sharded, tied = _sharded_and_tied(plan)
    links = Collectives(plan.dp, cost.latency_s, cost.bandwidth_bytes_per_s, plan.meta.dp_shard)
    step = data_parallel_step(plan.schedule, ends, plan.meta.zero, sharded, tied, links, flat=flat)
    return [max(0.0, (e[-1] if e else 0.0) + g + t - makespan_s)
            for e, g, t in zip(ends, step.gather_s, step.tail_s, strict=True)]
