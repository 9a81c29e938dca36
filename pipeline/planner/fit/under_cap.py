"""Make a plan fit `memory.cap_bytes` on every device, or say which device does not and by how much.

Under `remat=auto` the devices over the cap recompute chosen blocks in the backward, each full or
selectively (`pipelaunch.pipeline.planner.passes.remat`: an ILP that frees the bytes, net of the
rerun buffer, for the least recompute time); the plan records them per stage
(`StagePlan.recompute`, `StagePlan.selective`), their saved bytes leave the stage's activations,
their rerun time joins its backward (twice on a split I/W backward), the largest recomputed
block's rerun is priced as a buffer, and the schedule is simulated again. Since a stage's micro-batches need not all be held at the device's busiest
moment, the result is checked on the new simulation and the ILP asked again for more than its
last choice freed on paper, so that every round tries another choice.

The floor: per device, the choice that frees the most on paper (`remat.least_recompute`), kept
where the simulation agrees it lowers that device's peak, all simulated together. Its peaks are
what a refusal reports, and a cap at or above the largest of them is met: when the rounds do not
get under it, that choice itself is returned. A device whose floor is still over the cap can
recompute its stages whole instead (`R` actions: the partitioner prices stages before the
schedule is simulated, so it may leave to modules a stage that only fits whole); given a way to
build the plan again with those stages whole (`rebuild`), that plan is fitted the same way and
the lower floor of the two reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import networkx as nx

from pipelaunch.pipeline.core.errors import ConfigError, ranges
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.planner.passes.remat import (
    RecomputeInfeasible,
    RecomputeOption,
    apply_recompute,
    choose_recompute,
    least_recompute,
    net_frees,
    recompute_options,
)
from pipelaunch.pipeline.planner.predict.memory import MIB, BudgetExceeded, over_budget
from pipelaunch.pipeline.planner.predict.prediction import (
    Prediction,
    grad_replicas,
    predict,
    with_collectives,
)

#: what helps besides recomputation
OTHER_REMEDIES = ("pick a schedule that holds fewer micro-batches (1f1b rather than gpipe), use more stages or a "
                  "memory-aware split (partitioner=balanced), or let plan=auto search for a configuration that fits.")
REMEDIES = ("Recompute every block (remat=full, or remat=selective: the attention core and elementwise work only) or "
            "chosen blocks (remat=auto), " + OTHER_REMEDIES)
AUTO_REMEDIES = "Otherwise: " + OTHER_REMEDIES
#: rounds of (choose, simulate) before falling back to the floor's choice
ROUNDS = 6

#: the same plan built again with these stages recomputing whole (`R` actions)
Rebuild = Callable[[list[int]], Plan]


def fit_budget(plan: Plan, prediction: Prediction, graph: nx.DiGraph, cap: float | None, latency_s: float,
               bandwidth: float, rebuild: Rebuild | None = None) -> Prediction:
    """The prediction of a plan within `cap` on every device (recomputing where remat=auto allows);
    raises BudgetExceeded naming each device over it, its breakdown and the excess (under
    remat=auto: the peaks of the floor, the least the plan can hold, and the smallest cap it meets).
    `rebuild`: under remat=auto, how to build this plan again with other stages recomputing whole.
    `prediction` leaves the replicas' collectives out (`predict(..., collectives=False)`): the fit
    reads memory only, and prices them on the one prediction it returns or raises with."""
    over = over_budget(prediction.devices, cap)
    if not over:
        return with_collectives(prediction)
    assert cap is not None
    if plan.meta.remat != "auto":
        raise BudgetExceeded(over, cap, sharding_hint(plan, cap, latency_s, bandwidth) + REMEDIES,
                             with_collectives(prediction))
    fitted, floor = _recompute_layers(plan, prediction, graph, cap, latency_s, bandwidth)
    if fitted is not None:
        return with_collectives(fitted)
    shown = (plan, floor)
    whole = sorted(plan.schedule.remat_stages())
    ranks = {d.rank for d in over_budget(floor.devices, cap)}
    more = sorted(set(whole) | {s.index for s in plan.stages if s.rank in ranks})
    alt = _rebuilt(rebuild, more) if more != whole else None
    if alt is not None:
        alt_prediction = predict(alt, latency_s, bandwidth, collectives=False)
        if not over_budget(alt_prediction.devices, cap):
            return with_collectives(alt_prediction)
        fitted, alt_floor = _recompute_layers(alt, alt_prediction, graph, cap, latency_s, bandwidth)
        if fitted is not None:
            return with_collectives(fitted)
        if alt_floor.peak_bytes < floor.peak_bytes:
            shown = (alt, alt_floor)
    why = _floor_message(*shown, graph) + AUTO_REMEDIES
    raise BudgetExceeded(over_budget(shown[1].devices, cap), cap, why, with_collectives(shown[1]))


def sharding_hint(plan: Plan, cap: float, latency_s: float, bandwidth: float) -> str:
    """With replicas, what the sharding levels above this one (and at zero=3 `reshard=use` for
    `run`) hold on the fullest device, the first that fits named: `zero=3 would hold 41.2 MiB on
    its fullest device, within the cap. `"""
    if grad_replicas(plan) < 2 or not plan.schedule.training:
        return ""
    meta = plan.meta
    options = ([(3, "use")] if (meta.zero, meta.reshard) == (3, "run") else []) + \
        [(z, "use") for z in range(meta.zero + 1, 4)]
    tried = []
    for zero, reshard in options:
        other = replace(plan, meta=replace(meta, zero=zero, reshard=reshard))
        peak = predict(other, latency_s, bandwidth, collectives=False).peak_bytes
        name = f"zero={zero}" + (" reshard=use" if (meta.zero, meta.reshard) == (3, "run") and zero == 3 else "")
        if peak <= cap:
            return f"{name} would hold {peak / MIB:.1f} MiB on its fullest device, within the cap. "
        tried.append(f"{name} {peak / MIB:.1f} MiB")
    return f"Sharding more would still be over the cap ({', '.join(tried)} on the fullest device). " if tried else ""


def _rebuilt(rebuild: Rebuild | None, whole: list[int]) -> Plan | None:
    """The plan built again with `whole` recomputing whole, or None where there is no way to, or
    the schedule cannot (the plan as it stands is then the one refused)."""
    if rebuild is None:
        return None
    try:
        return rebuild(whole)
    except ConfigError:
        return None


def _recompute_layers(plan: Plan, prediction: Prediction, graph: nx.DiGraph, cap: float, latency_s: float,
                      bandwidth: float) -> tuple[Prediction | None, Prediction]:
    """(the plan's prediction within the cap, recomputing chosen modules, or None; its floor)."""
    part = plan.meta.partition
    plain_act = list(part.stage_activation_bytes)
    whole = set(plan.schedule.remat_stages())  # stages that already recompute entirely (R actions)
    split = {s.index for s in plan.stages if s.index > 0} if plan.schedule.meta.get("split_backward") else set()
    options = [o for o in recompute_options(graph, plan.assignment, split) if o.stage not in whole]
    held = dict(enumerate(part.stage_in_flight))
    rank_of = {s.index: s.rank for s in plan.stages}
    excess = {d.rank: d.total - cap for d in over_budget(prediction.devices, cap)}
    for _ in range(ROUNDS):
        try:
            chosen = choose_recompute(options, held, rank_of, excess, plan.microbatches)
        except RecomputeInfeasible:
            break
        attempt = predict(apply_recompute(plan, graph, chosen, plain_act), latency_s, bandwidth, collectives=False)
        still = over_budget(attempt.devices, cap)
        if not still:
            return attempt, attempt
        for d in still:  # more than the last choice freed on paper, by what is still missing
            mine = [o for s, picked in chosen.items() if rank_of[s] == d.rank for o in picked]
            excess[d.rank] = max(excess.get(d.rank, 0.0), net_frees(mine, held)) + d.total - cap
    floor = _floor(plan, graph, options, held, rank_of, plain_act, prediction, latency_s, bandwidth)
    return (None if over_budget(floor.devices, cap) else floor), floor


def _floor(plan: Plan, graph: nx.DiGraph, options: list[RecomputeOption], held: dict[int, int], rank_of: dict[int, int],
           plain_act: list[float], plain: Prediction, latency_s: float, bandwidth: float) -> Prediction:
    """The least each device can hold under remat=auto with this split and schedule: per device,
    the candidate modules that free the most (`least_recompute`), simulated together; a device
    whose simulated peak that raises (its rerun buffer outweighs what it frees where its peak
    falls) recomputes nothing, and the rest are simulated again. Depends on the plan alone, not
    on the cap: every cap at or above its largest peak is met by this choice."""
    chosen: dict[int, list[RecomputeOption]] = {}
    for rank in sorted(set(rank_of.values())):
        for o in least_recompute([o for o in options if rank_of[o.stage] == rank], held):
            chosen.setdefault(o.stage, []).append(o)
    floor = predict(apply_recompute(plan, graph, chosen, plain_act), latency_s, bandwidth, collectives=False)
    worse = {d.rank for d, p in zip(floor.devices, plain.devices, strict=True) if d.total > p.total}
    if worse:
        chosen = {s: picked for s, picked in chosen.items() if rank_of[s] not in worse}
        floor = predict(apply_recompute(plan, graph, chosen, plain_act), latency_s, bandwidth, collectives=False)
    return floor


def _floor_message(plan: Plan, floor: Prediction, graph: nx.DiGraph) -> str:
    """Why recomputation cannot close the gap, in the numbers a user sets the cap by: the peaks
    above are the floor's, and the smallest cap this split and schedule meet is the largest. The
    floor leaves out a module whose rerun buffer outweighs what recomputing it frees (a stage
    holding one micro-batch frees its saved bytes once and holds all of them again to rerun it)."""
    whole = plan.schedule.remat_stages()
    held = dict(enumerate(plan.meta.partition.stage_in_flight))
    candidates = {(o.stage, o.node) for o in recompute_options(graph, plan.assignment, False)
                  if o.stage not in whole and held.get(o.stage, 0) * o.saves_bytes > 0}
    recomputed = {(s.index, n) for s in floor.plan.stages for n in [*s.recompute, *s.selective]}
    modules = "every other candidate block recomputed" if whole else "every candidate block recomputed"
    if not candidates <= recomputed:
        modules += " but those whose rerun holds more than they free"
    what = f"stages {ranges(whole)} recomputed whole and {modules}" if whole else modules
    least = floor.peak_bytes
    return (f"remat=auto cannot close it: those are the peaks with {what}, so the smallest cap this split and "
            f"schedule meet is {least / MIB:.1f} MiB (memory.cap_bytes={math.ceil(least / 1e6)}e6). ")
