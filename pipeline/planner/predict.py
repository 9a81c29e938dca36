"""Predict a run before it starts: simulate the plan on its profile, or pick the schedule by it.

`scheduler=auto` plans and simulates every candidate schedule (the options of the scheduler config
group, a user's own included) on the measured profile and keeps the fastest; `mode=plan` prints
the same prediction without starting any rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pipeline.costs import cost_model_from_plan
from pipeline.errors import ConfigError
from pipeline.placement import classify
from pipeline.plan import Plan
from pipeline.schedules.auto import pick_fastest
from pipeline.schedules.base import ScheduleGenerator
from pipeline.simulate import CostModel, SimResult, simulate


@dataclass
class Prediction:
    plan: Plan
    cost: CostModel
    result: SimResult


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
    """Simulate a profiled plan's schedule on its per-stage costs."""
    cost = cost_model_from_plan(plan, latency_s, bandwidth)
    return Prediction(plan, cost, simulate(plan.schedule, cost))


def choose_schedule(
    build: Callable[[ScheduleGenerator], Plan],
    candidates: Sequence[ScheduleGenerator],
    pp: int,
    microbatches: int,
    latency_s: float,
    bandwidth: float,
) -> tuple[ScheduleGenerator, Prediction, list[dict]]:
    """Plan and simulate each training candidate on the profile; return the fastest and the table
    (candidates that cannot run these settings are listed with the reason)."""
    skipped: list[dict] = []

    def simulated():
        for gen in candidates:
            if not gen.training:
                continue
            try:
                pred = predict(build(gen), latency_s, bandwidth)
            except ConfigError as err:  # e.g. more stages than blocks, or the placement does not fit
                skipped.append({"name": gen.name, "skipped": str(err)})
                continue
            yield gen, classify(pred.plan.schedule.placement), pred

    try:
        winner, prediction, rows = pick_fastest(simulated(), pp, microbatches)
    except ConfigError:
        raise ConfigError("scheduler", f"scheduler=auto found no schedule that runs pp={pp}, "
                                       f"microbatches={microbatches}: {skipped}") from None
    return winner, prediction, rows + skipped
