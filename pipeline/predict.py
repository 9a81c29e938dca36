"""Predict a run before it starts: profile the blocks, simulate the plan, or pick the schedule.

`scheduler=auto` simulates every schedule valid for the given pp, micro-batches and placement on
the measured block profile and keeps the fastest; `mode=plan` prints the same prediction without
starting any rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from models.base import ModelSpec
from pipeline.costs import cost_model_from_blocks, cost_model_from_plan
from pipeline.errors import ConfigError
from pipeline.graph.profile import BlockCost, profile_blocks
from pipeline.placement import classify
from pipeline.plan import Plan
from pipeline.schedules.auto import pick_fastest
from pipeline.schedules.base import ScheduleGenerator
from pipeline.schedules.registry import valid_generators
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


def measure_blocks(spec: ModelSpec, model_cfg: dict, micro_batch_size: int, seed: int, threads: int) -> list[BlockCost]:
    """Profile every block at the per-rank thread count the ranks will use (cached on disk)."""
    with profiling_threads(threads):
        return profile_blocks(spec, micro_batch_size, seed=seed, device="cpu", model_config=model_cfg)


def predict(plan: Plan, blocks: Sequence[BlockCost] | None, latency_s: float, bandwidth: float) -> Prediction:
    if blocks is None:  # graph path: the plan carries its profiled stage costs
        cost = cost_model_from_plan(plan, latency_s, bandwidth)
    else:
        cost = cost_model_from_blocks(plan, blocks, latency_s, bandwidth)
    return Prediction(plan, cost, simulate(plan.schedule, cost))


def choose_schedule(
    build: Callable[[ScheduleGenerator], Plan],
    pp: int,
    microbatches: int,
    placement_kind: str | None,
    blocks: Sequence[BlockCost] | None,
    latency_s: float,
    bandwidth: float,
) -> tuple[ScheduleGenerator, Prediction, list[dict]]:
    """Plan and simulate each valid training schedule on the profile; return the fastest and the table."""
    skipped: list[dict] = []

    def candidates():
        for gen in valid_generators(pp, microbatches, placement_kind):
            if not gen.training:
                continue
            try:
                pred = predict(build(gen), blocks, latency_s, bandwidth)
            except ConfigError as err:  # e.g. more stages than blocks for 2-stage-per-rank schedules
                skipped.append({"name": gen.name, "skipped": str(err)})
                continue
            yield gen, classify(pred.plan.schedule.placement), pred

    try:
        winner, prediction, rows = pick_fastest(candidates(), pp, microbatches, placement_kind)
    except ConfigError:
        raise ConfigError("scheduler", f"scheduler=auto found no schedule that runs pp={pp}, "
                                       f"microbatches={microbatches}: {skipped}") from None
    return winner, prediction, rows + skipped


def format_choice(rows: Sequence[dict]) -> str:
    lines = [f"{'schedule':<18} {'predicted step':>14} {'bubble':>7} {'peak act MB':>11}"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['name']:<18} skipped: {r['skipped']}")
            continue
        mark = "  <- chosen" if r["chosen"] else ""
        lines.append(
            f"{r['name']:<18} {r['makespan_s'] * 1e3:>11.1f} ms {r['bubble']:>7.1%} "
            f"{r['peak_activation_bytes'] / 2**20:>11.1f}{mark}"
        )
    return "\n".join(lines)


def format_prediction(pred: Prediction) -> str:
    res = pred.result
    lines = [f"simulated step: {res.makespan_s * 1e3:.1f} ms (lower bound {res.lower_bound_s * 1e3:.1f} ms)"]
    lines.append(f"{'rank':>4} {'busy ms':>9} {'bubble':>7} {'peak act MB':>11} {'peak mbs':>8}")
    for r in range(len(res.busy_s)):
        lines.append(
            f"{r:>4} {res.busy_s[r] * 1e3:>9.1f} {res.bubble[r]:>7.1%} "
            f"{res.peak_activation_bytes[r] / 2**20:>11.2f} {res.peak_activation_microbatches[r]:>8}"
        )
    return "\n".join(lines)
