"""Text tables people read: the stage table and the simulated step."""

from __future__ import annotations

import re
from collections.abc import Sequence

from pipelaunch.pipeline.core.errors import ranges
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.core.results import RankFacts
from pipelaunch.pipeline.planner.partition.uniform import layer_container
from pipelaunch.pipeline.planner.predict.simulate import SimResult


def block_summary(blocks: list[str], keep: int = 8) -> str:
    """A stage's blocks for a table row: all of them, or the ends and a count when there are many
    (an operator-level stage holds hundreds of nodes)."""
    if len(blocks) <= keep:
        return ", ".join(blocks)
    return f"{', '.join(blocks[:3])} ... {', '.join(blocks[-3:])} ({len(blocks)} nodes)"


def layer_summaries(plan: Plan, keep: int = 8) -> list[str] | None:
    """Per stage, what it holds in layers when its nodes are too many to list (an operator-level
    trace of a layer list): `embed_tokens + layers 0-1 (170 nodes)`, `layers 6-7 + norm, lm_head
    (...)`, a layer whose tensors several stages share marked `part of layer 3`. None when every
    stage's blocks fit in a row or the stages' tensors show no layer list."""
    tensors = plan.meta.stage_tensors
    if len(tensors) != len(plan.stages) or all(len(s.blocks) <= keep for s in plan.stages):
        return None
    found = layer_container({t for ts in tensors for t in ts})
    if found is None:
        return None
    _, layer_of = found
    holders: dict[int, set[int]] = {}
    for s, ts in enumerate(tensors):
        for t in ts:
            if t in layer_of:
                holders.setdefault(layer_of[t], set()).add(s)
    first_layer = min(holders, default=0)
    out = []
    for s, ts in enumerate(tensors):
        mine = sorted({layer_of[t] for t in ts if t in layer_of})
        whole = [i for i in mine if holders[i] == {s}]
        part = [i for i in mine if holders[i] != {s}]
        others = list(dict.fromkeys(t.rsplit(".", 1)[0].rsplit(".", 1)[-1] for t in ts if t not in layer_of))
        held = []
        if whole:
            held.append(f"layer{'s' if len(whole) > 1 else ''} {ranges(whole)}")
        if part:
            held.append(f"part of layer{'s' if len(part) > 1 else ''} {ranges(part)}")
        text = ", ".join(held)
        if others:
            text = (f"{', '.join(others)} + {text}" if first_layer in mine else f"{text} + {', '.join(others)}") \
                if text else ", ".join(others)
        out.append(f"{text} ({len(plan.stages[s].blocks)} nodes)" if text else block_summary(plan.stages[s].blocks))
    return out


def _blockranges(blocks: list[str]) -> str:
    """Block names with their numbers as ranges: `model.model.layers.0-3, 5`, `layer0-7`."""
    by_stem: dict[str, list[int]] = {}
    other = []
    for b in blocks:
        found = re.fullmatch(r"(.*?)(\d+)", b)
        if found:
            by_stem.setdefault(found.group(1), []).append(int(found.group(2)))
        else:
            other.append(b)
    return ", ".join([f"{stem}{ranges(nums)}" for stem, nums in by_stem.items()] + other)


def stage_rows(plan: Plan) -> list[dict]:
    """One dict per stage for metrics.json: placement, blocks and, with a profile, its costs."""
    part = plan.meta.partition
    rows = []
    for s in plan.stages:
        row = {"stage": s.index, "rank": s.rank, "blocks": list(s.blocks), "send_bytes": s.send_bytes,
               "receives_from": sorted({p for p in s.inputs.values() if p is not None})}
        for key in ("stage_compute_s", "stage_time_s", "stage_param_bytes", "stage_activation_bytes",
                    "stage_comm_bytes"):
            if part is not None:
                row[key.removeprefix("stage_")] = getattr(part, key)[s.index]
        if plan.meta.stage_forward_s:
            row["forward_s"], row["backward_s"] = plan.meta.stage_forward_s[s.index], plan.meta.stage_backward_s[s.index]
        rows.append(row)
    return rows


def stage_table(plan: Plan) -> str:
    """Per stage: rank and blocks (on an operator-level trace, the layers and other modules it
    holds: `layer_summaries`); with a profile also time, parameter and activation bytes, the
    micro-batches the schedule keeps in flight there and what that holds (what a memory budget
    caps), and send bytes."""
    part = plan.meta.partition
    held = layer_summaries(plan) or [block_summary(s.blocks) for s in plan.stages]
    if not part or not plan.meta.stage_forward_s:
        lines = [f"{'stage':>5} {'rank':>4}  blocks"]
        lines += [f"{s.index:>5} {s.rank:>4}  {held[s.index]}" for s in plan.stages]
        return "\n".join(lines)
    mib = 2**20
    fwd, bwd = plan.meta.stage_forward_s, plan.meta.stage_backward_s
    remat = set(plan.schedule.remat_stages())
    in_flight = [f"{n}{'*' if i in remat else ''}" for i, n in enumerate(part.stage_in_flight)]
    in_flight = in_flight or ["?"] * len(plan.stages)
    lines = [f"{'stage':>5} {'rank':>4} {'F ms':>7} {'B ms':>7} {'+comm ms':>8} {'params MB':>9} {'act MB':>7} "
             f"{'x mbs':>5} {'held MB':>8} {'send MB':>7}  blocks"]
    for s in plan.stages:
        i = s.index
        lines.append(
            f"{i:>5} {s.rank:>4} {fwd[i] * 1e3:>7.2f} {bwd[i] * 1e3:>7.2f} {part.stage_time_s[i] * 1e3:>8.2f} "
            f"{part.stage_param_bytes[i] / mib:>9.2f} {part.stage_activation_bytes[i] / mib:>7.2f} "
            f"{in_flight[i]:>5} {part.stage_memory_bytes[i] / mib:>8.2f} "
            f"{part.stage_comm_bytes[i] / mib:>7.2f}  {held[i]}"
        )
    if remat:
        lines.append("* recomputes its forward in the backward (remat): full activations for "
                     + ", ".join(f"{part.stage_full_in_flight[i]} on stage {i}" for i in sorted(remat))
                     + ", the inputs of the rest")
    layers = [s for s in plan.stages if s.recompute or s.selective]
    if layers:
        lines.append(f"blocks recomputed in the backward (remat={plan.meta.remat}; full: inputs kept, selective: "
                     "the matmuls' outputs kept too): "
                     + "; ".join(f"stage {s.index}: " + ", ".join(
                         ([f"full {_blockranges(s.recompute)}"] if s.recompute else [])
                         + ([f"selective {_blockranges(s.selective)}"] if s.selective else [])) for s in layers))
    if plan.meta.device_memory:
        lines.append(device_memory_table(plan))
    lines.append(
        f"partition ({plan.meta.partitioner}): bottleneck {part.bottleneck_s * 1e3:.2f} ms, lower bound "
        f"max(total / stages, slowest block) {part.lower_bound_s * 1e3:.2f} ms "
        f"({part.bottleneck_s / max(part.lower_bound_s, 1e-12):.2f}x)"
    )
    return "\n".join(lines)


def device_memory_table(plan: Plan, ranks: Sequence[RankFacts] | None = None) -> str:
    """Per pipeline rank, the predicted peak by what holds it; with the ranks' run reports, what they
    measured beside it: the state held at the optimizer step (`RankFacts.state_bytes`) against the
    predicted params + grads + optim, the tensors' peak (CUDA's allocated peak; on CPU, the profiled
    first steps) against the prediction less the reserve, and the resident set's rise (on CPU, above
    what the process held apart from its tensors) against the whole prediction."""
    mib = 2**20
    cap = plan.meta.memory_cap
    gathered = any(d.gathered for d in plan.meta.device_memory)
    head = (f"{'rank':>5} {'params':>8} {'grads':>8} {'optim':>8} {'act':>8} {'recomp':>7} {'wkspace':>7} "
            + (f"{'gathered':>8} " if gathered else "") + f"{'update':>7} {'reserve':>7} {'predicted':>10}"
            + (f" {'state':>8} {'ratio':>6} {'tensors':>8} {'ratio':>6} {'resident':>9} {'ratio':>6}" if ranks else ""))
    units = units_line(plan) if plan.dp > 1 and plan.schedule.training else None
    lines = [f"memory per device, MiB (predicted peak{f'; cap {cap / mib:.1f}' if cap else ''}):",
             *([sharding_line(plan)] if plan.meta.zero else []), *([units] if units else []), head]
    state: dict[int, list[float]] = {}
    tensors: dict[int, list[float]] = {}
    resident: dict[int, list[float]] = {}
    for r in ranks or []:
        resident.setdefault(r.pp_rank, []).append(r.peak_above_start_bytes)
        if r.peak_tensor_bytes is not None:
            tensors.setdefault(r.pp_rank, []).append(r.peak_tensor_bytes)
        if r.state_bytes is not None:
            state.setdefault(r.pp_rank, []).append(r.state_bytes)
    for d in plan.meta.device_memory:
        row = (f"{d.rank:>5} {d.params / mib:>8.1f} {d.grads / mib:>8.1f} {d.optimizer / mib:>8.1f} "
               f"{d.activations / mib:>8.1f} {d.recompute / mib:>7.1f} {d.workspace / mib:>7.1f} "
               + (f"{d.gathered / mib:>8.1f} " if gathered else "")
               + f"{d.update / mib:>7.1f} {d.reserve / mib:>7.1f} {d.total / mib:>10.1f}")
        if ranks:
            row += (_measured(state.get(d.rank), d.params + d.grads + d.optimizer, 8)
                    + _measured(tensors.get(d.rank), d.total - d.reserve, 8)
                    + _measured(resident.get(d.rank), d.total, 9))
        lines.append(row)
    return "\n".join(lines)


def _measured(values: list[float] | None, predicted: float, width: int) -> str:
    """` 57.1   0.88`: the largest of a pipeline rank's replicas' measures (MiB) and its ratio to the
    prediction; a dash where no replica measured it."""
    if not values:
        return f" {'-':>{width}} {'':>6}"
    got = max(values)
    return f" {got / 2**20:>{width}.1f} {got / predicted if predicted else 0.0:>6.2f}"


#: per sharding level: what it shards, and what its backward holds unsharded (the gathered column)
_SHARDED = {1: ("optimizer states", "; gathered: a block's reduce-scatter input in the stage's last backward"),
            2: ("optimizer states and gradients",
                "; gathered: a block's gradients and their reduce-scatter input, in every backward"),
            3: ("optimizer states, gradients and parameters", "")}
#: zero=3: what each release point (`reshard`) holds gathered
_RESHARD = {"use": "; reshard=use, gathered: the block computing, the next one prefetched and a block's gradients",
            "run": "; reshard=run, gathered: the stage's blocks until its run of actions ends, and a block's "
                   "gradients"}


def sharding_line(plan: Plan) -> str:
    """`zero=2 over dp=2: optimizer states and gradients sharded; ...`: the level the memory table
    prices, and what its window holds."""
    what, window = _SHARDED[plan.meta.zero]
    if plan.meta.zero == 3:
        window = _RESHARD.get(plan.meta.reshard, "")
    tied = " (tied parameters whole)" if any(plan.meta.stage_replicated_param_bytes or []) else ""
    mixed = f"; computes in {plan.meta.precision}, reduces in fp32" if plan.meta.precision != "fp32" else ""
    return f"zero={plan.meta.zero} over dp={plan.dp}: {what} sharded{tied}{window}{mixed}"


def units_line(plan: Plan, keep: int = 4) -> str | None:
    """`units (gathered and reduced together), MiB: stage 0: embed.tokens+embed.positions 4.1, layer0 3.0, ...`:
    each stage's units as the runtime cuts them (None for a plan without them)."""
    if not plan.meta.stage_units:
        return None
    mib = 2**20
    parts = []
    for s, units in enumerate(plan.meta.stage_units):
        named = [f"{u.name} {u.param_bytes / mib:.1f}" for u in units]
        if len(named) > keep:
            named = [*named[:2], f"... ({len(named)} units)", named[-1]]
        parts.append(f"stage {s}: {', '.join(named) or 'none'}")
    return "units (gathered and reduced together), MiB: " + "; ".join(parts)


def format_prediction(res: SimResult) -> str:
    """The simulated step: makespan, and per rank busy time, bubble and peak activations."""
    lines = [f"simulated step: {res.makespan_s * 1e3:.1f} ms (lower bound {res.lower_bound_s * 1e3:.1f} ms)"]
    lines.append(f"{'rank':>4} {'busy ms':>9} {'bubble':>7} {'peak act MB':>11} {'peak mbs':>8}")
    for r in range(len(res.busy_s)):
        lines.append(
            f"{r:>4} {res.busy_s[r] * 1e3:>9.1f} {res.bubble[r]:>7.1%} "
            f"{res.peak_activation_bytes[r] / 2**20:>11.2f} {res.peak_activation_microbatches[r]:>8}"
        )
    return "\n".join(lines)
