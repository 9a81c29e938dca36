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
from pipelaunch.pipeline.planner.predict.memory import (
    DeviceMemory,
    Sharding,
    UpdateMemory,
    device_memory,
    rank_param_bytes,
)
from pipelaunch.pipeline.planner.predict.shared_cores import shared_makespan
from pipelaunch.pipeline.planner.predict.simulate import CostModel, SimResult, simulate


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

    @property
    def step_s(self) -> float:
        """A training step: the schedule, then the slowest rank's optimizer step."""
        return self.schedule_s + max(self.optimizer_s, default=0.0)

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
                            sharding=Sharding(plan.meta.zero, plan.dp, plan.meta.precision),
                            replicated_bytes=plan.meta.stage_replicated_param_bytes)
    schedule_s = result.makespan_s
    slots = machine.rank_slots
    if slots:  # more local ranks than cores: busy ranks share them (pipeline/planner/predict/shared_cores.py)
        schedule_s = shared_makespan(plan.schedule, cost, slots, plan.dp)
    per_byte = float(machine.optimizer_s_per_byte or 0.0)
    # on every parameter byte at every sharding level: the step time does not price sharding yet
    # (neither its smaller optimizer step nor its collectives), so levels tie on time
    whole = rank_param_bytes(plan.meta.partition.stage_param_bytes, plan.schedule.placement)
    optimizer = [p * per_byte for p in whole]
    return Prediction(plan, cost, result, devices, schedule_s, optimizer)
