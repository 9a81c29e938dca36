"""Which leaf modules to recompute: the cheapest set that brings every rank under its memory budget.

Why per layer and why an ILP: recomputing a whole stage (an `R` action) pays its full forward again
to save all of its activations, while a rank over its budget by a few percent only needs the
activations of a module or two dropped. Choosing which is a covering knapsack per rank: each
option frees `held x saves_bytes` and costs `microbatches x cost_s`, and the rank holds again the
activations of the largest module it reruns (`rerun_bytes`: the device's recompute buffer,
`memory.device_memory`), so a choice frees its options' bytes less that buffer. HiGHS solves it
exactly at the sizes a plan has (tens to a few hundred leaf modules), once per distinct buffer.

The runtime side is `pipelaunch.pipeline.graph.recompute` (the chosen nodes run under non-reentrant
`torch.utils.checkpoint`); its recompute counts are what `recompute_options` charges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

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
    #: what the rank holds again while this module reruns in a backward (its saved activations);
    #: a rank's recompute buffer is the largest of these among the modules it recomputes
    rerun_bytes: float = 0.0


class RecomputeInfeasible(ValueError):
    """No choice of a rank's candidate modules frees its excess (net of the recompute buffer)."""

    def __init__(self, rank: int, excess_bytes: float, max_saves_bytes: float) -> None:
        self.rank, self.excess_bytes, self.max_saves_bytes = rank, excess_bytes, max_saves_bytes
        super().__init__(
            f"pipeline rank {rank} is {excess_bytes:.0f} bytes over its memory budget, but recomputing candidate "
            f"leaf modules of its stages frees at most {max_saves_bytes:.0f} bytes (net of their rerun buffer)")


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
        options.append(RecomputeOption(node, stage, saves, float(d.get("forward_s", 0.0)) * (2 if split else 1),
                                       float(d.get("activation_bytes", 0))))
    return options


def net_frees(options: Sequence[RecomputeOption], held: Mapping[int, int]) -> float:
    """What recomputing `options` (all of one rank) frees at the rank's peak as the ILP counts it:
    each one's saved bytes per micro-batch its stage holds, less the largest rerun buffer."""
    return sum(held.get(o.stage, 0) * o.saves_bytes for o in options) - max((o.rerun_bytes for o in options),
                                                                            default=0.0)


def least_recompute(options: Sequence[RecomputeOption], held: Mapping[int, int]) -> list[RecomputeOption]:
    """Of one rank's options, the set that frees the most (`net_frees`); empty when none frees anything.

    Why it is exact: for a given largest rerun buffer t, every option whose buffer is at most t
    only adds what it frees, so the best set is some "every option with rerun_bytes <= t"; there are
    as many of those as distinct buffers. Everything recomputed is the last of them, and not always
    the best: a module whose own rerun outweighs what the others free is left out."""
    useful = sorted((o for o in options if held.get(o.stage, 0) * o.saves_bytes > 0), key=lambda o: o.rerun_bytes)
    best: list[RecomputeOption] = []
    best_net, total = 0.0, 0.0
    for i, o in enumerate(useful):
        total += held[o.stage] * o.saves_bytes
        if i + 1 < len(useful) and useful[i + 1].rerun_bytes == o.rerun_bytes:
            continue  # a threshold takes every option at its buffer size
        if total - o.rerun_bytes > best_net:
            best_net, best = total - o.rerun_bytes, useful[: i + 1]
    return best


def choose_recompute(
    options: Sequence[RecomputeOption],
    held: Mapping[int, int],
    rank_of_stage: Mapping[int, int],
    excess_bytes: Mapping[int, float],
    microbatches: int,
) -> dict[int, list[str]]:
    """Per rank r with `excess_bytes[r] > 0`: the options of r's stages with
    `net_frees >= excess_bytes[r]` (what they free per micro-batch held, less the largest rerun
    buffer among them) at the least `microbatches * sum(cost_s)` (the step time recomputation adds
    on that rank). Returns stage -> sorted node names (stages with no choice left out). Raises
    RecomputeInfeasible when no choice of a rank's options is enough (`least_recompute`'s)."""
    chosen: dict[int, list[str]] = {}
    for rank, excess in sorted(excess_bytes.items()):
        if excess <= 0:
            continue
        mine = [o for o in options if rank_of_stage.get(o.stage) == rank and held.get(o.stage, 0) * o.saves_bytes > 0]
        most = least_recompute(mine, held)
        if net_frees(most, held) < excess:
            raise RecomputeInfeasible(rank, excess, net_frees(most, held))
        for o in _cover(mine, held, excess, microbatches, most):
            chosen.setdefault(o.stage, []).append(o.node)
    return {s: sorted(nodes) for s, nodes in sorted(chosen.items())}


def _cover(
    options: list[RecomputeOption], held: Mapping[int, int], excess: float, microbatches: int,
    most: list[RecomputeOption],
) -> list[RecomputeOption]:
    """The cheapest options whose `net_frees` is at least `excess`, given that `most` (a subset of
    them) is such a choice.

    Per candidate buffer t (each distinct `rerun_bytes`), the options whose buffer is at most t
    must free `excess + t`: a plain covering knapsack, the cheapest of which over every t is the
    answer (the best set's largest buffer is one of the t). Why not one integer program with the
    buffer as a variable: scaled to the buffer, an excess far smaller than it falls within
    HiGHS's tolerances (1e-6; a 1-byte excess beside a 0.5 MB buffer came back as met by nothing)."""
    best, best_cost = most, sum(o.cost_s for o in most)
    for t in sorted({o.rerun_bytes for o in options}):
        mine = [o for o in options if o.rerun_bytes <= t]
        frees = [held[o.stage] * o.saves_bytes for o in mine]
        if sum(frees) < excess + t:
            continue
        pick = _knapsack(mine, frees, excess + t, microbatches)
        cost = sum(o.cost_s for o in pick)
        if net_frees(pick, held) >= excess and cost < best_cost:
            best, best_cost = pick, cost
    return best


def _knapsack(
    options: list[RecomputeOption], frees: list[float], need: float, microbatches: int
) -> list[RecomputeOption]:
    """The cheapest options freeing at least `need`, given that all of them together do."""
    if len(options) == 1:
        return options
    from scipy.optimize import (  # a plan that recomputes nothing never pays for it
        Bounds,
        LinearConstraint,
        milp,
    )

    costs = np.array([microbatches * o.cost_s for o in options], dtype=float)
    # scaled so HiGHS's absolute tolerances mean the same at bytes ~1e9 and seconds ~1e-6
    c = costs / costs.max() if costs.max() > 0 else costs
    # an option freeing more than is needed covers it alone: clipped to it, every coefficient lies
    # in (0, 1] against a right-hand side of 1, the same binary solutions
    row = np.minimum(np.array(frees, dtype=float), need) / need
    for slack in _TIGHTEN:
        res = milp(c, integrality=np.ones(len(options)), bounds=Bounds(0, 1),
                   constraints=[LinearConstraint(row[None, :], 1.0 + slack, np.inf)],
                   options={"time_limit": TIME_LIMIT_S, "mip_rel_gap": 0.0, "disp": False})
        if res.x is None:
            break
        pick = [o for o, x in zip(options, res.x, strict=True) if x > 0.5]
        if sum(f for f, x in zip(frees, res.x, strict=True) if x > 0.5) >= need:
            return pick
    return options  # no solution in time: all of them do (checked by the caller)


def per_module_suffices(graph: nx.DiGraph, part, stage_cap: float) -> set[int]:
    """The stages the partition marked to recompute whole that recomputing their candidate modules
    would bring under `stage_cap` (priced as the partition prices a stage: its parameters, its
    activations per micro-batch held, less what the candidates that free the most free, plus the
    largest of them rerun: `least_recompute`).

    Why prefer modules: a whole-stage rerun (an `R` action) holds the full activations of the
    micro-batch being recomputed on top of every held input, while recomputing blocks holds one
    block's at a time; at block granularity the per-module choice frees more for no more
    forward time. remat=auto's ILP then picks only what the simulated schedule needs."""
    options = recompute_options(graph, part.assignment, False)
    keep = set()
    for s in part.remat_stages:
        held = {s: part.stage_in_flight[s]}
        most = least_recompute([o for o in options if o.stage == s], held)
        least = part.stage_param_bytes[s] + held[s] * part.stage_activation_bytes[s] - net_frees(most, held)
        if most and least <= stage_cap:
            keep.add(s)
    return keep
