"""Cost models for the simulator, from the plan's profile (before a run) or from a run's own events.

Both give per-stage F, I, W and recompute times plus activation and transfer bytes, so the same
simulator predicts a run before it starts and explains it afterwards.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from pipelaunch.pipeline.core.plan import Plan, StagePlan, dtype_of
from pipelaunch.pipeline.planner.predict.simulate import CostModel

#: share of a measured backward that is weight-gradient work when only B was timed.
DEFAULT_WEIGHT_SHARE = 0.5


def split_backward_cost(backward_s: Sequence[float], weight_share: float = DEFAULT_WEIGHT_SHARE) -> tuple[list[float], list[float]]:
    """(I, W) per stage from measured backward times. Stage 0 reads only the data, so it has no
    input gradient: its I is free and its W is the whole backward."""
    w = [b * weight_share for b in backward_s]
    i = [b - x for b, x in zip(backward_s, w, strict=True)]
    if backward_s:
        i[0], w[0] = 0.0, float(backward_s[0])
    return i, w


def cost_model_from_events(
    plan: Plan, events: Sequence[dict], latency_s: float, bandwidth: float, fallback: CostModel | None = None
) -> CostModel:
    """Median measured duration of each (stage, kind) in this run; B splits into I/W when only B ran,
    and where a fused B ran beside split ones (schedules/fuse.py) it keeps its own, lower cost."""
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in events:  # a paired action's (moe.overlap) own work, not the span its partner shared
        durations[(e["stage"], e["kind"])].append(e.get("busy_s", e["end_s"] - e["start_s"]))

    def med(stage: int, kind: str) -> float | None:
        values = durations.get((stage, kind))
        return statistics.median(values) if values else None

    n = len(plan.stages)
    fwd, bwd_i, bwd_w, rec, bwd = [], [], [], [], []
    for s in range(n):
        f = med(s, "F") or (fallback.forward_s[s] if fallback else 0.0)
        i, w, b = med(s, "I"), med(s, "W"), med(s, "B")
        if i is None or w is None:
            total = b if b is not None else (fallback.backward_s[s] if fallback else 0.0)
            w = total if s == 0 else total * DEFAULT_WEIGHT_SHARE  # stage 0 has no input gradient
            i = total - w
        r = med(s, "R") or f
        fwd.append(f)
        bwd_i.append(i)
        bwd_w.append(w)
        bwd.append(b if b is not None else i + w)
        rec.append(r)
    act = fallback.activation_bytes if fallback else None
    inp = [float(p.recv_bytes) for p in plan.stages]
    out = [float(p.send_bytes) for p in plan.stages]
    # memory as the fallback (the plan's profile) prices it; a run's events carry no bytes
    memory = {} if fallback is None else {"held_after_input_grad": fallback.held_after_input_grad,
                                          "weight_stash_bytes": fallback.weight_stash_bytes,
                                          "input_grad_freed_bytes": fallback.input_grad_freed_bytes}
    return CostModel(fwd, bwd_i, bwd_w, rec, act, inp, out, latency_s, bandwidth, backward_s=bwd,
                     edge_bytes=edge_bytes(plan.stages), overlap_exchange_s=overlap_exchange_s(plan), **memory)


def held_output_bytes(stage: StagePlan) -> float:
    """Bytes of the values a stage keeps per micro-batch until its backward: each output once
    (however many stages read it), and on the last stage the model output."""
    names = set(stage.outputs) | ({stage.loss_value} if stage.loss_value else set())
    return float(sum(stage.value_bytes(n) for n in names if n in stage.values))


def cost_model_from_plan(plan: Plan, latency_s: float, bandwidth: float) -> CostModel:
    """A profiled plan carries the per-stage forward/backward sums of its nodes."""
    fwd = list(plan.meta.stage_forward_s)
    bwd = [float(b) for b in plan.meta.stage_backward_s]
    if plan.meta.stage_backward_input_s:  # the split backward as profiled: dearer than B
        bwd_i = [float(x) for x in plan.meta.stage_backward_input_s]
        bwd_w = [float(x) for x in plan.meta.stage_backward_weight_s]
    else:
        bwd_i, bwd_w = split_backward_cost(bwd, DEFAULT_WEIGHT_SHARE)
    # modules recomputed inside a backward (per-layer remat): their forward runs again in B, and in
    # a split backward once in I and once more in W (each is its own autograd pass; stage 0 has no
    # input gradient, its whole backward is W)
    for s, extra in enumerate(plan.meta.stage_recompute_s or []):
        bwd[s] += extra
        bwd_w[s] += extra
        if s > 0:
            bwd_i[s] += extra
    # the runtime's fixed cost per compute action (measured: pipelaunch.pipeline.planner.measure.overheads)
    fixed = float(plan.meta.machine.action_overhead_s or 0.0)
    if fixed:
        fwd, bwd, bwd_i, bwd_w = ([x + fixed for x in xs] for xs in (fwd, bwd, bwd_i, bwd_w))
    act, freed = stage_held_bytes(plan.stages, plan.meta.partition.stage_activation_bytes,
                                  plan.meta.stage_loss_activation_bytes)
    stash = plan.meta.stage_weight_stash_bytes
    return CostModel(
        fwd, bwd_i, bwd_w, None, act,
        [float(s.recv_bytes) for s in plan.stages], [float(s.send_bytes) for s in plan.stages], latency_s, bandwidth,
        backward_s=bwd, weight_stash_bytes=[float(b) for b in stash] if stash is not None else None,
        input_grad_freed_bytes=freed, edge_bytes=edge_bytes(plan.stages), overlap_exchange_s=overlap_exchange_s(plan),
    )


def overlap_exchange_s(plan: Plan) -> list[float] | None:
    """Under moe.overlap, per stage its all-to-alls' seconds in one micro-batch's forward (half of
    `stage_exchange_s`, the backward's being the same); None when actions run one at a time."""
    if not plan.moe_overlap or plan.meta.stage_exchange_s is None:
        return None
    exchange = plan.meta.stage_exchange_s
    return [float(x) / 2 for x in exchange]


def edge_bytes(stages: Sequence[StagePlan]) -> dict[tuple[int, int], tuple[float, float]]:
    """Per edge (producer, consumer) between stages, the bytes one rank sends forward and the
    gradients it gets back (floating-point values only), as the lowering's messages carry them."""
    out: dict[tuple[int, int], list[float]] = {}
    for stage in stages:
        for name, producer in stage.inputs.items():
            if producer is None:
                continue
            nbytes = float(stage.wire_bytes(name))
            sums = out.setdefault((producer, stage.index), [0.0, 0.0])
            sums[0] += nbytes
            if dtype_of(stage.values[name][1]).is_floating_point:
                sums[1] += nbytes
    return {edge: (f, g) for edge, (f, g) in out.items()}


def stage_held_bytes(stages: Sequence[StagePlan], activation_bytes: Sequence[float],
                     loss_activation_bytes: Sequence[float] | None) -> tuple[list[float], list[float]]:
    """Per stage, what a micro-batch holds from its F (its saved tensors and, until its backward,
    the outputs it produced: on the last stage the model output the loss was taken on, e.g. an LM's
    logits) and what a split backward's I frees of it. The I keeps the autograd graph for W
    (retain_graph) except what lies above the nodes W restarts from: the outputs and the loss's
    saved tensors go, and the gradients W restarts from come (`weight_stash_bytes`;
    compute/backward.py, both profiled, see planner/measure/profile.py)."""
    held = [held_output_bytes(s) for s in stages]
    act = [float(a) + h for a, h in zip(activation_bytes, held, strict=True)]
    loss = loss_activation_bytes or [0.0] * len(held)
    return act, [h + float(x) for h, x in zip(held, loss, strict=True)]
