"""Make a plan fit `memory.cap_bytes` on every device, or say which device does not and by how much.

Under `remat=auto` the devices over the cap recompute chosen leaf modules in the backward
(`pipelaunch.pipeline.planner.remat`: an ILP that frees the bytes for the least recompute time); the plan
records them per stage (`StagePlan.recompute`), their saved bytes leave the stage's activations,
their forward time joins its backward (twice on a split I/W backward), the largest recomputed
module's activations are priced as a buffer, and the schedule is simulated again. Since a stage's
micro-batches need not all be held at the device's busiest moment, the result is checked on the
new simulation and the ILP asked again for what is still missing.
"""

from __future__ import annotations

import math
from dataclasses import replace

import networkx as nx

from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.planner.memory import MIB, BudgetExceeded, over_budget
from pipelaunch.pipeline.planner.predict import Prediction, predict
from pipelaunch.pipeline.planner.remat import (
    RecomputeInfeasible,
    RecomputeOption,
    choose_recompute,
    recompute_options,
)

#: what helps besides recomputation
OTHER_REMEDIES = ("pick a schedule that holds fewer micro-batches (1f1b rather than gpipe), use more stages or a "
                  "memory-aware split (partitioner=balanced), or let plan=auto search for a configuration that fits.")
REMEDIES = "Recompute chosen modules (remat=auto), " + OTHER_REMEDIES
AUTO_REMEDIES = "Otherwise: " + OTHER_REMEDIES
#: rounds of (choose, simulate) before giving up on a device whose peak moves with the choice
ROUNDS = 6


def fit_budget(plan: Plan, prediction: Prediction, graph: nx.DiGraph, cap: float | None, latency_s: float,
               bandwidth: float) -> Prediction:
    """The prediction of a plan within `cap` on every device (recomputing where remat=auto allows);
    raises BudgetExceeded naming each device over it, its breakdown and the excess (under
    remat=auto: with everything recomputed, the least the plan can hold)."""
    over = over_budget(prediction.devices, cap)
    if not over:
        return prediction
    assert cap is not None
    if plan.meta.remat != "auto":
        raise BudgetExceeded(over, cap, REMEDIES, prediction)
    return _recompute_layers(plan, prediction, graph, cap, latency_s, bandwidth)


def _recompute_layers(plan: Plan, prediction: Prediction, graph: nx.DiGraph, cap: float, latency_s: float,
                      bandwidth: float) -> Prediction:
    part = plan.meta.partition
    plain_act = list(part["stage_activation_bytes"])
    whole = set(plan.schedule.remat_stages())  # stages that already recompute entirely (R actions)
    split = {s.index for s in plan.stages if s.index > 0} if plan.schedule.meta.get("split_backward") else set()
    options = [o for o in recompute_options(graph, plan.assignment, split) if o.stage not in whole]
    held = dict(enumerate(part["stage_in_flight"]))
    rank_of = {s.index: s.rank for s in plan.stages}
    excess = {d.rank: d.total - cap for d in over_budget(prediction.devices, cap)}
    for _ in range(ROUNDS):
        try:
            chosen = choose_recompute(options, held, rank_of, excess, plan.microbatches)
        except RecomputeInfeasible:
            floor = _floor(plan, graph, options, plain_act, latency_s, bandwidth)
            why = _floor_message(plan, prediction, floor) + AUTO_REMEDIES
            raise BudgetExceeded(over_budget(floor.devices, cap), cap, why, floor) from None
        plan = _apply(plan, graph, options, chosen, plain_act)
        prediction = predict(plan, latency_s, bandwidth)
        still = over_budget(prediction.devices, cap)
        if not still:
            return prediction
        for d in still:  # ask for what is still missing on top of what was asked
            excess[d.rank] = excess.get(d.rank, 0.0) + d.total - cap
    raise BudgetExceeded(over_budget(prediction.devices, cap), cap,
                         "remat=auto found no recomputation that keeps it under the cap. " + AUTO_REMEDIES, prediction)


def _floor(plan: Plan, graph: nx.DiGraph, options: list[RecomputeOption], plain_act: list[float],
           latency_s: float, bandwidth: float) -> Prediction:
    """The plan's prediction with every candidate module recomputed: the least each device can hold
    under remat=auto with this split and schedule."""
    every: dict[int, list[str]] = {}
    for o in options:
        every.setdefault(o.stage, []).append(o.node)
    return predict(_apply(plan, graph, options, every, plain_act), latency_s, bandwidth)


def _floor_message(plan: Plan, plain: Prediction, floor: Prediction) -> str:
    """Why recomputation cannot close the gap, in the numbers a user sets the cap by: the peaks
    above are those with everything recomputed; the smallest cap this plan meets is the largest of
    each device's least (recomputing may cost a device more than it frees: its rerun buffer)."""
    whole = plan.schedule.remat_stages()
    what = (f"stages {', '.join(map(str, whole))} recomputed whole and every other candidate module recomputed"
            if whole else "every candidate module recomputed")
    least = max(min(p.total, f.total) for p, f in zip(plain.devices, floor.devices, strict=True))
    return (f"remat=auto cannot close it: those are the peaks with {what}, so the smallest cap this split and "
            f"schedule meet is {least / MIB:.1f} MiB (memory.cap_bytes={math.ceil(least / 1e6)}e6). ")


def _apply(plan: Plan, graph: nx.DiGraph, options: list[RecomputeOption], chosen: dict[int, list[str]],
           plain_act: list[float]) -> Plan:
    """The plan with the choice recorded: per stage the recomputed nodes, the activations they no
    longer hold, the forward time they add to the backward and the largest one's buffer."""
    saves = {(o.stage, o.node): o.saves_bytes for o in options}
    plan = plan.with_recompute(chosen)
    k = len(plan.stages)
    activation, recompute_s, region = list(plain_act), [0.0] * k, [0.0] * k
    for stage in plan.stages:
        s, nodes = stage.index, stage.recompute
        activation[s] = plain_act[s] - sum(saves[(s, n)] for n in nodes)
        recompute_s[s] = sum(float(graph.nodes[n].get("forward_s", 0.0)) for n in nodes)
        region[s] = max((float(graph.nodes[n].get("activation_bytes", 0)) for n in nodes), default=0.0)
    return replace(plan, meta=replace(
        plan.meta, partition={**plan.meta.partition, "stage_activation_bytes": activation},
        stage_recompute_s=recompute_s, stage_recompute_region_bytes=region,
        recompute={str(s.index): s.recompute for s in plan.stages if s.recompute}))
