"""Which leaf modules to recompute: the cheapest set that brings every rank under its memory budget.

Why per layer and why an ILP: recomputing a whole stage (an `R` action) pays its full forward again
to save all of its activations, while a rank over its budget by a few percent only needs the
activations of a module or two dropped. Choosing which is a covering knapsack per rank: each
option frees `held x saves_bytes` and costs `microbatches x cost_s`; HiGHS solves it exactly at
the sizes a plan has (tens to a few hundred leaf modules).

The runtime side is `pipelaunch.pipeline.graph.recompute` (the chosen nodes run under non-reentrant
`torch.utils.checkpoint`); its recompute counts are what `recompute_options` charges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

TIME_LIMIT_S = 10.0
#: relative slack demanded of the covering row on a retry, when HiGHS's feasibility tolerance let
#: a choice fall a few bytes short
_TIGHTEN = (0.0, 1e-6, 1e-4)


@dataclass(frozen=True)
class RecomputeOption:
    """One leaf module that may be recomputed, with what that frees and what it costs."""

    node: str  # graph node name (a call_module node: a leaf module)
    stage: int
    saves_bytes: float  # activation bytes freed per micro-batch held if recomputed (>= 0)
    cost_s: float  # extra seconds per micro-batch if recomputed (forward x reruns per backward)


class RecomputeInfeasible(ValueError):
    """Even recomputing every candidate module of a rank leaves it over its budget."""

    def __init__(self, rank: int, excess_bytes: float, max_saves_bytes: float) -> None:
        self.rank, self.excess_bytes, self.max_saves_bytes = rank, excess_bytes, max_saves_bytes
        super().__init__(
            f"pipeline rank {rank} is {excess_bytes:.0f} bytes over its memory budget, but recomputing every "
            f"candidate leaf module of its stages frees at most {max_saves_bytes:.0f} bytes")


def recompute_options(
    graph: nx.DiGraph, assignment: Mapping[str, int], split_backward: set[int] | bool
) -> list[RecomputeOption]:
    """Every leaf module (cost-graph node with `op == "call_module"`) whose recomputation frees memory.

    Checkpointing a module keeps its inputs, so it frees its saved activations minus its inputs'
    bytes (every predecessor's output, on this stage or received). Left out: nodes that read a
    model input directly (the cost graph does not know those bytes) and nodes producing a model
    output (their profiled activations include the loss's saved tensors, which stay). The runtime
    reruns a checkpointed module's forward once per backward graph task: once with a fused
    backward, twice on a stage whose backward is split into I and W (in I, then once for all of
    W's restarts), so `cost_s` is `forward_s` times 1 or 2 (`split_backward`: the split stages,
    or True / False for all / none). A stage with no differentiable input (the first) runs its
    whole backward in W even under a split schedule: it recomputes once."""
    outputs = set(graph.graph.get("outputs", ()))
    options = []
    for node, d in graph.nodes(data=True):
        if d.get("op") != "call_module" or node in outputs or d.get("reads_inputs") or node not in assignment:
            continue
        stage = assignment[node]
        kept = sum(int(graph.nodes[p].get("output_bytes", 0)) for p in graph.predecessors(node))
        saves = float(d.get("activation_bytes", 0)) - kept
        if saves <= 0:
            continue
        split = split_backward if isinstance(split_backward, bool) else stage in split_backward
        options.append(RecomputeOption(node, stage, saves, float(d.get("forward_s", 0.0)) * (2 if split else 1)))
    return options


def choose_recompute(
    options: Sequence[RecomputeOption],
    held: Mapping[int, int],
    rank_of_stage: Mapping[int, int],
    excess_bytes: Mapping[int, float],
    microbatches: int,
) -> dict[int, list[str]]:
    """Per rank r with `excess_bytes[r] > 0`: the options of r's stages whose
    `sum(held[stage] * saves_bytes) >= excess_bytes[r]` at the least `microbatches * sum(cost_s)`
    (the step time recomputation adds on that rank). Returns stage -> sorted node names (stages
    with no choice left out). Raises RecomputeInfeasible when recomputing every option of a rank
    is not enough."""
    chosen: dict[int, list[str]] = {}
    for rank, excess in sorted(excess_bytes.items()):
        if excess <= 0:
            continue
        mine = [o for o in options if rank_of_stage.get(o.stage) == rank and held.get(o.stage, 0) * o.saves_bytes > 0]
        frees = [held[o.stage] * o.saves_bytes for o in mine]
        if sum(frees) < excess:
            raise RecomputeInfeasible(rank, excess, sum(frees))
        for o in _cover(mine, frees, excess, microbatches):
            chosen.setdefault(o.stage, []).append(o.node)
    return {s: sorted(nodes) for s, nodes in sorted(chosen.items())}


def _cover(
    options: list[RecomputeOption], frees: list[float], excess: float, microbatches: int
) -> list[RecomputeOption]:
    """The cheapest options freeing at least `excess`, given that all of them together do."""
    if len(options) == 1:
        return options
    costs = np.array([microbatches * o.cost_s for o in options], dtype=float)
    # scaled so HiGHS's absolute tolerances mean the same at bytes ~1e9 and seconds ~1e-6
    c = costs / costs.max() if costs.max() > 0 else costs
    # an option freeing more than the excess covers it alone: clipped to it, every coefficient lies
    # in (0, 1] against a right-hand side of 1, the same binary solutions
    row = np.minimum(np.array(frees, dtype=float), excess) / excess
    for slack in _TIGHTEN:
        res = milp(c, integrality=np.ones(len(options)), bounds=Bounds(0, 1),
                   constraints=[LinearConstraint(row[None, :], 1.0 + slack, np.inf)],
                   options={"time_limit": TIME_LIMIT_S, "mip_rel_gap": 0.0, "disp": False})
        if res.x is None:
            break
        pick = [o for o, x in zip(options, res.x, strict=True) if x > 0.5]
        if sum(f for f, x in zip(frees, res.x, strict=True) if x > 0.5) >= excess:
            return pick
    return options  # no solution in time: recomputing everything is feasible (checked by the caller)


def per_module_suffices(graph: nx.DiGraph, part, stage_cap: float) -> set[int]:
    """The stages the partition marked to recompute whole that recomputing their candidate modules
    would bring under `stage_cap` (priced as the partition prices a stage: its parameters, its
    activations per micro-batch held, less what every candidate frees, plus the largest one rerun).

    Why prefer modules: a whole-stage rerun (an `R` action) holds the full activations of the
    micro-batch being recomputed on top of every held input, while recomputing blocks holds one
    block's at a time; at block granularity the per-module choice frees more for no more
    forward time. remat=auto's ILP then picks only what the simulated schedule needs."""
    options = recompute_options(graph, part.assignment, False)
    keep = set()
    for s in part.remat_stages:
        mine = [o for o in options if o.stage == s]
        region = max((float(graph.nodes[o.node].get("activation_bytes", 0)) for o in mine), default=0.0)
        held = part.stage_in_flight[s]
        least = part.stage_param_bytes[s] + held * (part.stage_activation_bytes[s] - sum(o.saves_bytes for o in mine))
        if mine and least + region <= stage_cap:
            keep.add(s)
    return keep
