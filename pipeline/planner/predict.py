"""Predict a run before it starts: simulate the plan on its profile and price each device's memory.

`mode=plan` prints this prediction without starting any rank; `plan=auto` and `scheduler=auto`
(`pipeline.planner.search`) rank their candidates by it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from hydra.utils import instantiate

from pipeline.core.config import PluginConfig
from pipeline.core.plan import Plan
from pipeline.planner.costs import cost_model_from_plan
from pipeline.planner.memory import DeviceMemory, device_memory
from pipeline.planner.shared_cores import shared_makespan
from pipeline.planner.simulate import CostModel, SimResult, simulate


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
    part = plan.meta.partition
    devices = device_memory(part["stage_param_bytes"], plan.schedule.placement, result.peak_activation_bytes,
                            int(plan.meta.optimizer_states), plan.meta.stage_recompute_region_bytes,
                            plan.meta.stage_workspace_bytes, float(plan.meta.reserve_bytes or 0.0))
    schedule_s = result.makespan_s
    slots = plan.meta.rank_slots
    if slots:  # more local ranks than cores: busy ranks share them (pipeline/planner/shared_cores.py)
        schedule_s = shared_makespan(plan.schedule, cost, slots, plan.dp)
    per_byte = float(plan.meta.optimizer_s_per_byte or 0.0)
    optimizer = [d.params * per_byte for d in devices]
    return Prediction(plan, cost, result, devices, schedule_s, optimizer)


def optimizer_seconds_per_byte(optimizer_cfg: PluginConfig, threads: int, numel: int = 1 << 20) -> float:
    """Time one step of the configured optimizer over a parameter of `numel` floats, per byte of
    parameter (median of a few steps, at the ranks' thread count): its cost grows with the bytes
    it updates, and a stage's parameter bytes are known before any rank exists."""
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.full_like(param, 1e-3)
    with profiling_threads(threads):
        opt = instantiate(optimizer_cfg)([param])
        times = []
        for _ in range(5):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / (numel * param.element_size())
