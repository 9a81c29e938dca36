"""Which blocks to recompute, and how: none, selective or full, per block of every stage.

A block is the outermost numbered module its nodes run in (`pipeline/graph/recompute.py`: a
transformer layer). Recomputed *full*, it keeps only its inputs and reruns its forward inside its
backward (Megatron's full recomputation, torchtitan's activation checkpointing); *selective*, it
also keeps the outputs of the dense matrix products (`pipeline/compute/selective.py`: the attention
core and the elementwise work are what it reruns, Korthikanti et al. 2022). `remat=full` and
`remat=selective` apply one of them to every block; `remat=auto` chooses per block under the
memory cap: the cheapest set that brings every rank under its budget.

Why per block and why an ILP: recomputing a whole stage (an `R` action, `remat=stage`) pays its
full forward again to save all of its activations and holds them all again to rerun it, while a
rank over its budget by a few percent needs one block or two dropped. Choosing is a covering
knapsack per rank: each option frees `held x saves_bytes` and costs `microbatches x cost_s`, at most
one option per block, and the rank holds again the activations of the largest block it reruns
(`rerun_bytes`: the device's recompute buffer, `memory.device_memory`), so a choice frees its
options' bytes less that buffer. HiGHS solves it exactly at the sizes a plan has (tens to a few
hundred blocks), once per distinct buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import networkx as nx
import numpy as np

from pipelaunch.pipeline.core.plan import Plan

TIME_LIMIT_S = 10.0
#: relative slack demanded of the covering row on a retry, when HiGHS's feasibility tolerance let
#: a choice fall a few bytes short
_TIGHTEN = (0.0, 1e-6, 1e-4)


@dataclass(frozen=True)
class RecomputeOption:
    """One way to recompute one block of one stage, with what that frees and what it costs."""

    node: str  # the block (`graph.recompute.block_of`): `layer3`, `model.model.layers.3`
    stage: int
    saves_bytes: float  # activation bytes freed per micro-batch held if recomputed
    cost_s: float  # extra seconds per micro-batch if recomputed (its rerun x reruns per backward)
    #: what the rank holds again while this block reruns in a backward (what the rerun rebuilds);
    #: a rank's recompute buffer is the largest of these among the blocks it recomputes
    rerun_bytes: float = 0.0
    #: under the selective policy (the matmuls' outputs kept), else full (only the inputs kept)
    selective: bool = False
    #: seconds of one rerun (`cost_s` counts a split backward's two); None: `cost_s`
    rerun_s: float | None = None
    #: the activations of the stage's nodes after the block, which its micro-batch's backward has
    #: freed by the time the block reruns (the buffer adds only what exceeds them)
    later_bytes: float = 0.0

    @property
    def block(self) -> tuple[int, str]:
        return self.stage, self.node


class RecomputeInfeasible(ValueError):
    """No choice of a rank's candidate blocks frees its excess (net of the recompute buffer)."""

    def __init__(self, rank: int, excess_bytes: float, max_saves_bytes: float) -> None:
        self.rank, self.excess_bytes, self.max_saves_bytes = rank, excess_bytes, max_saves_bytes
        super().__init__(
            f"pipeline rank {rank} is {excess_bytes:.0f} bytes over its memory budget, but recomputing candidate "
            f"blocks of its stages frees at most {max_saves_bytes:.0f} bytes (net of their rerun buffer)")


def stage_blocks(graph: nx.DiGraph, assignment: Mapping[str, int]) -> dict[tuple[int, str], list[str]]:
    """(stage, block) -> its nodes in program order, for every block that can be recomputed: the
    cost graph's `block` of each node; a block holding a node that makes the model's output is
    left out (its profile holds the loss's saved tensors, which stay)."""
    outputs = set(graph.graph.get("outputs", ()))
    groups: dict[tuple[int, str], list[str]] = {}
    for node, d in sorted(graph.nodes(data=True), key=lambda item: item[1].get("order", 0)):
        if d.get("block") is not None and node in assignment:
            groups.setdefault((assignment[node], d["block"]), []).append(node)
    return {key: nodes for key, nodes in groups.items() if not outputs & set(nodes)}


def _kept_inputs(graph: nx.DiGraph, nodes: Sequence[str]) -> float:
    """What checkpointing a block keeps of its inputs: every value from outside it that it reads
    (on this stage, received, or rebuilt from the inputs), each once."""
    inside = set(nodes)
    outside = {p for n in nodes for p in graph.predecessors(n) if p not in inside}
    return float(sum(int(graph.nodes[p].get("output_bytes", 0)) for p in outside))


def recompute_options(
    graph: nx.DiGraph, assignment: Mapping[str, int], split_backward: set[int] | bool, keep_all: bool = False,
) -> list[RecomputeOption]:
    """Each block's two options, full and selective, where it frees memory (every block with
    `keep_all`: remat=full and remat=selective recompute them whatever the profile says).

    Full frees the block's saved activations less its inputs (which checkpointing keeps) and
    costs its forward; selective also keeps what the policy keeps (`selective_kept_bytes` of its
    nodes, as profiled) and costs the share of its forward the policy reruns (`selective_share`). The runtime
    reruns a checkpointed block once per backward graph task: once with a fused backward, twice on
    a stage whose backward is split into I and W (in I, then once for all of W's restarts), so
    the cost counts 1 or 2 reruns (`split_backward`: the split stages, or True / False for all /
    none). A stage with no differentiable input (the first) runs its whole backward in W even
    under a split schedule: it recomputes once."""
    options = []
    order = {n: i for i, n in enumerate(sorted(graph.nodes, key=lambda n: graph.nodes[n].get("order", 0)))}
    for (stage, block), nodes in stage_blocks(graph, assignment).items():
        data = [graph.nodes[n] for n in nodes]
        last = max(order[n] for n in nodes)
        later = float(sum(graph.nodes[n].get("activation_bytes", 0) for n, s in assignment.items()
                          if s == stage and n in order and order[n] > last))
        act = float(sum(d.get("activation_bytes", 0) for d in data))
        kept = _kept_inputs(graph, nodes)
        forward = float(sum(d.get("forward_s", 0.0) for d in data))
        policy_kept = float(sum(d.get("selective_kept_bytes", 0) for d in data))
        rerun_s = float(sum(d.get("forward_s", 0.0) * d.get("selective_share", 1.0) for d in data))
        split = split_backward if isinstance(split_backward, bool) else stage in split_backward
        reruns = 2 if split and stage > 0 else 1
        full = RecomputeOption(block, stage, act - kept, forward * reruns, act, rerun_s=forward, later_bytes=later)
        selective = RecomputeOption(block, stage, act - kept - policy_kept, rerun_s * reruns,
                                    max(0.0, act - policy_kept), selective=True, rerun_s=rerun_s, later_bytes=later)
        options += [o for o in (full, selective) if keep_all or o.saves_bytes > 0]
    return options


def every_block(options: Sequence[RecomputeOption], selective: bool) -> dict[int, list[RecomputeOption]]:
    """remat=full / remat=selective: every block recomputed the one way."""
    chosen: dict[int, list[RecomputeOption]] = {}
    for o in options:
        if o.selective == selective:
            chosen.setdefault(o.stage, []).append(o)
    return chosen


def net_frees(options: Sequence[RecomputeOption], held: Mapping[int, int]) -> float:
    """What recomputing `options` (all of one rank) frees at the rank's peak as the ILP counts it:
    each one's saved bytes per micro-batch its stage holds, less the largest rerun buffer."""
    return sum(held.get(o.stage, 0) * o.saves_bytes for o in options) - max((o.rerun_bytes for o in options),
                                                                            default=0.0)


def least_recompute(options: Sequence[RecomputeOption], held: Mapping[int, int]) -> list[RecomputeOption]:
    """Of one rank's options, the set that frees the most (`net_frees`), one option per block;
    empty when none frees anything.

    Why it is exact: for a given largest rerun buffer t, every block whose options' buffers are at
    most t only adds what its best such option frees, so the best set is, for some t among the
    options' buffers, each block's best option within t. Everything recomputed is one of them, and
    not always the best: a block whose own rerun outweighs what the others free is left out."""
    useful = [o for o in options if held.get(o.stage, 0) * o.saves_bytes > 0]
    best: list[RecomputeOption] = []
    best_net = 0.0
    for t in sorted({o.rerun_bytes for o in useful}):
        pick: dict[tuple[int, str], RecomputeOption] = {}
        for o in useful:
            if o.rerun_bytes <= t and (o.block not in pick or o.saves_bytes > pick[o.block].saves_bytes):
                pick[o.block] = o
        chosen = list(pick.values())
        if net_frees(chosen, held) > best_net:
            best_net, best = net_frees(chosen, held), chosen
    return best


def choose_recompute(
    options: Sequence[RecomputeOption],
    held: Mapping[int, int],
    rank_of_stage: Mapping[int, int],
    excess_bytes: Mapping[int, float],
    microbatches: int,
) -> dict[int, list[RecomputeOption]]:
    """Per rank r with `excess_bytes[r] > 0`: the options of r's stages, one per block at most,
    with `net_frees >= excess_bytes[r]` (what they free per micro-batch held, less the largest
    rerun buffer among them) at the least `microbatches * sum(cost_s)` (the step time recomputation
    adds on that rank). Returns stage -> options in block order (stages with no choice left out).
    Raises RecomputeInfeasible when no choice of a rank's options is enough (`least_recompute`'s)."""
    chosen: dict[int, list[RecomputeOption]] = {}
    for rank, excess in sorted(excess_bytes.items()):
        if excess <= 0:
            continue
        mine = [o for o in options if rank_of_stage.get(o.stage) == rank and held.get(o.stage, 0) * o.saves_bytes > 0]
        most = least_recompute(mine, held)
        if net_frees(most, held) < excess:
            raise RecomputeInfeasible(rank, excess, net_frees(most, held))
        for o in _cover(mine, held, excess, microbatches, most):
            chosen.setdefault(o.stage, []).append(o)
    return {s: sorted(picked, key=lambda o: (o.node, o.selective)) for s, picked in sorted(chosen.items())}


def _cover(
    options: list[RecomputeOption], held: Mapping[int, int], excess: float, microbatches: int,
    most: list[RecomputeOption],
) -> list[RecomputeOption]:
    """The cheapest options, one per block, whose `net_frees` is at least `excess`, given that
    `most` (a subset of them) is such a choice.

    Per candidate buffer t (each distinct `rerun_bytes`), the options whose buffer is at most t
    must free `excess + t`: a covering knapsack with one option per block, the cheapest of which
    over every t is the answer (the best set's largest buffer is one of the t). Why not one integer
    program with the buffer as a variable: scaled to the buffer, an excess far smaller than it falls
    within HiGHS's tolerances (1e-6; a 1-byte excess beside a 0.5 MB buffer came back as met by
    nothing)."""
    best, best_cost = most, sum(o.cost_s for o in most)
    for t in sorted({o.rerun_bytes for o in options}):
        mine = [o for o in options if o.rerun_bytes <= t]
        frees = [held[o.stage] * o.saves_bytes for o in mine]
        if _most_per_block(mine, frees) < excess + t:
            continue
        pick = _knapsack(mine, frees, excess + t, microbatches)
        cost = sum(o.cost_s for o in pick)
        if net_frees(pick, held) >= excess and cost < best_cost:
            best, best_cost = pick, cost
    return best


def _most_per_block(options: Sequence[RecomputeOption], frees: Sequence[float]) -> float:
    """What the options free at most with one per block."""
    most: dict[tuple[int, str], float] = {}
    for o, f in zip(options, frees, strict=True):
        most[o.block] = max(most.get(o.block, 0.0), f)
    return sum(most.values())


def _knapsack(
    options: list[RecomputeOption], frees: list[float], need: float, microbatches: int
) -> list[RecomputeOption]:
    """The cheapest options, one per block, freeing at least `need`, given that some such set does."""
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
    blocks: dict[tuple[int, str], list[int]] = {}
    for i, o in enumerate(options):
        blocks.setdefault(o.block, []).append(i)
    pairs = [idx for idx in blocks.values() if len(idx) > 1]
    one_each = np.zeros((len(pairs), len(options)))
    for r, idx in enumerate(pairs):
        one_each[r, idx] = 1.0
    for slack in _TIGHTEN:
        constraints = [LinearConstraint(row[None, :], 1.0 + slack, np.inf)]
        if pairs:
            constraints.append(LinearConstraint(one_each, -np.inf, 1.0))
        res = milp(c, integrality=np.ones(len(options)), bounds=Bounds(0, 1), constraints=constraints,
                   options={"time_limit": TIME_LIMIT_S, "mip_rel_gap": 0.0, "disp": False})
        if res.x is None:
            break
        pick = [o for o, x in zip(options, res.x, strict=True) if x > 0.5]
        if sum(f for f, x in zip(frees, res.x, strict=True) if x > 0.5) >= need:
            return pick
    # no solution in time: each block's option freeing the most (checked by the caller)
    most: dict[tuple[int, str], int] = {}
    for i, o in enumerate(options):
        if o.block not in most or frees[i] > frees[most[o.block]]:
            most[o.block] = i
    return [options[i] for i in sorted(most.values())]


def apply_recompute(plan: Plan, graph: nx.DiGraph, chosen: Mapping[int, Sequence[RecomputeOption]],
                    plain_act: Sequence[float]) -> Plan:
    """The plan with the choice recorded: per stage the blocks recomputed full and selectively,
    the activations they no longer hold, the rerun time they add to the backward and the largest
    one's buffer. A rerun block's activations go as its backward makes the gradients its workspace
    holds, so a recomputing stage holds the larger of the two at once, not both: its workspace
    is recorded past the buffer (`plan.meta.stage_workspace_bytes`)."""
    k = len(plan.stages)
    activation, recompute_s, region = recompute_effect(chosen, plain_act, k)
    full = {s: [o.node for o in picked if not o.selective] for s, picked in chosen.items()}
    selective = {s: [o.node for o in picked if o.selective] for s, picked in chosen.items()}
    workspace = plan.meta.stage_workspace_bytes
    if workspace is not None:
        workspace = [max(0.0, w - r) if r > 0 else w for w, r in zip(workspace, region, strict=True)]
    plan = plan.with_recompute(full, selective)
    return replace(plan, meta=replace(
        plan.meta, partition=replace(plan.meta.partition, stage_activation_bytes=activation),
        stage_recompute_s=recompute_s, stage_recompute_region_bytes=region, stage_workspace_bytes=workspace,
        recompute={str(s.index): s.recompute for s in plan.stages if s.recompute},
        selective={str(s.index): s.selective for s in plan.stages if s.selective}))


def recompute_effect(chosen: Mapping[int, Sequence[RecomputeOption]], plain_act: Sequence[float], k: int
                     ) -> tuple[list[float], list[float], list[float]]:
    """Per stage, under the choice: the activation bytes a micro-batch holds, the seconds one
    rerun of its blocks adds to a backward (to each half of a split one: `predict.costs`), and the
    buffer: what a block's rerun holds beyond the activations of the blocks after it, which the
    micro-batch's backward freed before it reached the block (the largest over its blocks)."""
    activation, recompute_s, region = [float(a) for a in plain_act], [0.0] * k, [0.0] * k
    for s, picked in chosen.items():
        activation[s] = max(0.0, plain_act[s] - sum(max(0.0, o.saves_bytes) for o in picked))
        recompute_s[s] = sum(o.cost_s if o.rerun_s is None else o.rerun_s for o in picked)
        for o in picked:  # the blocks after it still freed what they hold: their kept bytes stay
            saved_later = sum(max(0.0, p.saves_bytes) for p in picked if p.later_bytes < o.later_bytes)
            region[s] = max(region[s], o.rerun_bytes - max(0.0, o.later_bytes - saved_later))
    return activation, recompute_s, region


def per_block_suffices(graph: nx.DiGraph, part, stage_cap: float) -> set[int]:
    """The stages the partition marked to recompute whole that recomputing their blocks would
    bring under `stage_cap` (priced as the partition prices a stage: its parameters, its
    activations per micro-batch held, less what the blocks that free the most free, plus the
    largest of them rerun: `least_recompute`).

    Why prefer blocks: a whole-stage rerun (an `R` action) holds the full activations of the
    micro-batch being recomputed on top of every held input, while recomputing blocks holds one
    block's at a time; at block granularity the per-block choice frees more for no more forward
    time. remat=auto's ILP then picks only what the simulated schedule needs."""
    options = recompute_options(graph, part.assignment, False)
    keep = set()
    for s in part.remat_stages:
        held = {s: part.stage_in_flight[s]}
        most = least_recompute([o for o in options if o.stage == s], held)
        least = part.stage_param_bytes[s] + held[s] * part.stage_activation_bytes[s] - net_frees(most, held)
        if most and least <= stage_cap:
            keep.add(s)
    return keep


def recomputed_view(graph: nx.DiGraph, selective: bool) -> nx.DiGraph:
    """The cost graph as a partitioner should price it when every block is recomputed (remat=full
    or selective): each block's nodes hold, per micro-batch, only what the recomputed block keeps
    (its inputs, and selectively what the policy keeps), shared out over them by their saved
    bytes. Times and everything else unchanged; the final price is the split's own options."""
    blocks: dict[str, list[str]] = {}
    for node, d in graph.nodes(data=True):
        if d.get("block") is not None:
            blocks.setdefault(d["block"], []).append(node)
    if not blocks:
        return graph
    outputs = set(graph.graph.get("outputs", ()))
    view = graph.copy()
    for nodes in blocks.values():
        if outputs & set(nodes):
            continue
        act = float(sum(graph.nodes[n].get("activation_bytes", 0) for n in nodes))
        if act <= 0:
            continue
        keep = _kept_inputs(graph, nodes) + (sum(float(graph.nodes[n].get("selective_kept_bytes", 0)) for n in nodes)
                                            if selective else 0.0)
        share = min(1.0, keep / act)
        for n in nodes:
            view.nodes[n]["activation_bytes"] = int(graph.nodes[n].get("activation_bytes", 0) * share)
    return view
