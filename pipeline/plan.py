"""The Plan: everything a rank needs to know before it runs, as one serialisable object.

Built once (by the launcher before spawning, or by rank 0 when joining), written as plan.json in
the run directory, and handed to every rank; planning is pure, execution is not.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from models.base import ModelSpec
from pipeline.errors import ConfigError
from pipeline.graph.profile import BlockCost, chain_graph
from pipeline.ir import Schedule
from pipeline.lowering import lower
from pipeline.partition import PARTITIONERS, Partition, evaluate, min_memory_cap
from pipeline.partition.common import memory_error
from pipeline.partition.rank_balance import rank_balanced_starts
from pipeline.placement import check_explicit, from_kind
from pipeline.schedules import build_schedule
from pipeline.schedules.base import ScheduleGenerator
from pipeline.stages import split_manual, split_uniform, stage_boundary_shapes


@dataclass
class StagePlan:
    """One stage: where it runs, what it holds, and the named values it reads and writes.

    `inputs[name]` is the producing stage (None: the model input from the data); `outputs[name]`
    lists the later stages that read it. `values[name]` = [shape, dtype] of one micro-batch, for
    every value crossing a stage boundary. `loss_value` names the model output the loss is taken
    on (last stage only).
    """

    index: int
    rank: int  # pipeline rank (0..pp-1) within each data-parallel replica
    blocks: list[str]  # block names (sequential models) or graph node names (traced models)
    inputs: dict[str, int | None]
    outputs: dict[str, list[int]]
    values: dict[str, list]
    loss_value: str | None = None

    def value_bytes(self, name: str) -> int:
        shape, dtype = self.values[name]
        n = 1
        for d in shape:
            n *= int(d)
        return n * torch.empty((), dtype=dtype_of(dtype)).element_size()

    @property
    def send_bytes(self) -> int:
        """Bytes this stage sends per micro-batch (one message per consuming stage)."""
        return sum(self.value_bytes(n) * len(c) for n, c in self.outputs.items())

    @property
    def recv_bytes(self) -> int:
        return sum(self.value_bytes(n) for n, p in self.inputs.items() if p is not None)


@dataclass
class Plan:
    pp: int
    dp: int
    microbatches: int
    micro_batch_size: int
    model: str
    stages: list[StagePlan]
    schedule: Schedule
    meta: dict = field(default_factory=dict)

    def stages_of(self, pp_rank: int) -> list[StagePlan]:
        return [s for s in self.stages if s.rank == pp_rank]

    def edges(self) -> list[tuple[int, int, str]]:
        """Every (producer stage, consumer stage, value) crossing a stage boundary, in a fixed
        order: its position is the edge id both ends of a message derive their tag from."""
        return sorted((p, s.index, name) for s in self.stages for name, p in s.inputs.items() if p is not None)

    @property
    def graph_path(self) -> bool:
        return "assignment" in self.meta

    def to_dict(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "schedule"}
        data["schedule"] = self.schedule.to_dict()
        return data

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1))

    def stage_rows(self) -> list[dict]:
        """One dict per stage for metrics.json: placement, blocks and, with a profile, its costs."""
        part = self.meta.get("partition") or {}
        rows = []
        for s in self.stages:
            row = {"stage": s.index, "rank": s.rank, "blocks": list(s.blocks), "send_bytes": s.send_bytes,
                   "receives_from": sorted({p for p in s.inputs.values() if p is not None})}
            for key in ("stage_compute_s", "stage_time_s", "stage_param_bytes", "stage_activation_bytes",
                        "stage_comm_bytes"):
                if key in part:
                    row[key.removeprefix("stage_")] = part[key][s.index]
            for key in ("stage_forward_s", "stage_backward_s"):
                if key in self.meta:
                    row[key.removeprefix("stage_")] = self.meta[key][s.index]
            rows.append(row)
        return rows

    def stage_table(self) -> str:
        """Per stage: rank and blocks; with a profile also time, parameter and activation bytes, the
        micro-batches the schedule keeps in flight there and what that holds (what a memory budget
        caps), and send bytes."""
        part = self.meta.get("partition")
        if part is None:
            lines = [f"{'stage':>5} {'rank':>4}  blocks"]
            lines += [f"{s.index:>5} {s.rank:>4}  {block_summary(s.blocks)}" for s in self.stages]
            return "\n".join(lines)
        mib = 2**20
        fwd = self.meta.get("stage_forward_s") or [float("nan")] * len(self.stages)
        bwd = self.meta.get("stage_backward_s") or [float("nan")] * len(self.stages)
        remat = set(self.schedule.remat_stages())
        in_flight = [f"{n}{'*' if i in remat else ''}" for i, n in enumerate(part.get("stage_in_flight") or [])]
        in_flight = in_flight or ["?"] * len(self.stages)
        lines = [f"{'stage':>5} {'rank':>4} {'F ms':>7} {'B ms':>7} {'+comm ms':>8} {'params MB':>9} {'act MB':>7} "
                 f"{'x mbs':>5} {'held MB':>8} {'send MB':>7}  blocks"]
        for s in self.stages:
            i = s.index
            lines.append(
                f"{i:>5} {s.rank:>4} {fwd[i] * 1e3:>7.2f} {bwd[i] * 1e3:>7.2f} {part['stage_time_s'][i] * 1e3:>8.2f} "
                f"{part['stage_param_bytes'][i] / mib:>9.2f} {part['stage_activation_bytes'][i] / mib:>7.2f} "
                f"{in_flight[i]:>5} {part['stage_memory_bytes'][i] / mib:>8.2f} "
                f"{part['stage_comm_bytes'][i] / mib:>7.2f}  {block_summary(s.blocks)}"
            )
        if remat:
            lines.append("* recomputes its forward in the backward (remat): full activations for "
                         + ", ".join(f"{part['stage_full_in_flight'][i]} on stage {i}" for i in sorted(remat))
                         + ", the inputs of the rest")
        lines.append(
            f"partition ({self.meta['partitioner']}): bottleneck {part['bottleneck_s'] * 1e3:.2f} ms, lower bound "
            f"max(total / stages, slowest block) {part['lower_bound_s'] * 1e3:.2f} ms "
            f"({part['bottleneck_s'] / part['lower_bound_s']:.2f}x)"
        )
        return "\n".join(lines)


def block_summary(blocks: list[str], keep: int = 8) -> str:
    """A stage's blocks for a table row: all of them, or the ends and a count when there are many
    (an operator-level stage holds hundreds of nodes)."""
    if len(blocks) <= keep:
        return ", ".join(blocks)
    return f"{', '.join(blocks[:3])} ... {', '.join(blocks[-3:])} ({len(blocks)} nodes)"


def resolve_placement(placement_cfg: dict, generator: ScheduleGenerator, pp: int) -> list[int]:
    kind = placement_cfg.get("kind", "auto")
    if kind == "explicit":
        ranks = placement_cfg.get("ranks")
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise ConfigError("placement.ranks", "placement=explicit needs a list of ranks, e.g. 'placement.ranks=[0,1,1,0]'")
        return check_explicit(ranks, pp)
    if kind == "auto":
        kind = generator.default_placement
    return from_kind(kind, pp, generator.stages_per_rank())


PARTITIONER_NAMES = ("uniform", "manual", "balanced", "milp")
PROFILED_PARTITIONERS = ("balanced", "milp")


@dataclass(frozen=True)
class StageCounts:
    """What the partitioners price a stage's activations by, from the schedule's unit-cost order
    (the split is cut before the measured stage costs exist; `in_flight_counts` builds it).

    `in_flight`: micro-batches each stage holds at once (`Schedule.peak_in_flight`);
    `remat_in_flight`: how many of them hold full activations on a stage that recomputes (None: no
    stage may); `remat_all`: every stage recomputes (remat=full) rather than those over the cap."""

    in_flight: list[int]
    remat_in_flight: list[int] | None = None
    remat_all: bool = False

    def pricing(self) -> dict:
        """Keyword arguments of `evaluate`, `balanced` and `min_memory_cap`."""
        return {"in_flight": self.in_flight, "remat_in_flight": self.remat_in_flight, "remat_all": self.remat_all}

    def for_milp(self, name: str) -> list[int]:
        """The MILP prices activations only: under remat=full it cuts on the recomputed ones (its
        split is then re-priced in full, `reprice_split`); remat=auto it cannot model: refused."""
        if self.remat_in_flight is None:
            return self.in_flight
        if self.remat_all:
            return self.remat_in_flight
        raise ConfigError(
            "remat",
            f"remat=auto with a memory budget chooses the stages to recompute while cutting, which "
            f"partitioner=balanced, uniform and manual do and partitioner={name} does not; use one of "
            f"those, or remat=full / remat=none with {name}.",
        )


def in_flight_counts(
    generator: ScheduleGenerator, placement: Sequence[int], microbatches: int, remat: str, cap: float | None
) -> StageCounts:
    """The counts a split is priced by for this schedule and `remat` (see StageCounts)."""
    placement = list(placement)
    plain = build_schedule(generator, placement, microbatches).peak_in_flight()
    if not generator.training or remat == "none" or (remat == "auto" and cap is None):
        return StageCounts(plain)
    recomputed = build_schedule(generator, placement, microbatches, "full").peak_in_flight()
    return StageCounts(plain, recomputed, remat_all=remat == "full")


def partition_blocks(
    partitioner_cfg: dict,
    spec: ModelSpec,
    placement: Sequence[int],
    block_costs: Sequence[BlockCost] | None,
    bandwidth: float,
    counts: StageCounts,
) -> tuple[list[list[str]], Partition | None]:
    """Cut the model's block chain into stages; with a profile, also say what the cut costs.

    balanced and milp minimise the slowest stage; when a rank holds several stages the split is
    then re-balanced so that the busiest rank, not just the slowest stage, is as light as it can be.
    `counts`: what each stage's memory is priced by, recomputation included (StageCounts)."""
    num_stages = len(placement)
    name = partitioner_cfg.get("name", "uniform")
    cap = partitioner_cfg.get("memory_cap_bytes")
    if name not in PARTITIONER_NAMES:
        raise ConfigError("partitioner", f"unknown partitioner {name!r}; valid: {', '.join(PARTITIONER_NAMES)}")
    if name in PROFILED_PARTITIONERS and block_costs is None:
        raise ConfigError("partitioner", f"partitioner={name} needs a block profile (the launcher measures one)")
    price = {"bandwidth": bandwidth, "memory_cap": cap, **counts.pricing()}
    if name == "uniform":
        blocks = split_uniform(spec.block_names, num_stages)
    elif name == "manual":
        blocks = split_manual(spec.block_names, list(partitioner_cfg.get("split_points") or []), num_stages)
    else:
        split_uniform(spec.block_names, num_stages)  # same "more stages than blocks" error for every partitioner
        graph = chain_graph(block_costs)
        if name == "milp":
            options = {"bandwidth": bandwidth, "memory_cap": cap, "in_flight": counts.for_milp(name),
                       "time_limit": float(partitioner_cfg.get("time_limit_s", 5.0))}
        else:
            options = price
        # priced by the one judge, recomputation included (the MILP does not see it)
        part = reprice_split(PARTITIONERS[name](graph, num_stages, **options), graph, **price)
        if len(set(placement)) == num_stages:
            return part.stages(), part
        names = [b.name for b in block_costs]
        starts = [names.index(stage[0]) for stage in part.stages()]
        costs = [b.forward_s + b.backward_s for b in block_costs]
        starts = rank_balanced_starts(costs, starts, placement)
        blocks = [names[a:b] for a, b in zip(starts, [*starts[1:], len(names)], strict=True)]
        rebalanced = evaluate(graph, {b: s for s, st in enumerate(blocks) for b in st}, num_stages,
                              method=f"{name}+ranks", **price)
        if cap is not None and max(rebalanced.stage_memory_bytes) > cap:
            return part.stages(), part  # the stage-balanced split is the one within budget
        return blocks, rebalanced
    if block_costs is None:
        return blocks, None
    graph = chain_graph(block_costs)
    assignment = {b: s for s, names in enumerate(blocks) for b in names}
    part = evaluate(graph, assignment, num_stages, **price)
    check_memory(part, cap, graph, num_stages, counts, name)
    return blocks, part


def reprice_split(part: Partition, graph, **price) -> Partition:
    """The same assignment priced again by `evaluate` with these terms; method and solver facts are kept."""
    out = evaluate(graph, part.assignment, part.num_stages, method=part.method, **price)
    out.info = dict(part.info)
    return out


def check_memory(part: Partition, cap: float | None, graph, num_stages: int, counts: StageCounts, name: str) -> None:
    """A fixed split (uniform, manual) over the budget: name the stage, and the smallest budget a
    contiguous split can meet (balanced/milp search within the budget themselves)."""
    if cap is None or max(part.stage_memory_bytes) <= cap:
        return
    worst = max(range(num_stages), key=lambda s: part.stage_memory_bytes[s])
    smallest = min_memory_cap(graph, num_stages, **counts.pricing())
    detail = (f"partitioner={name} puts {part.stage_memory_bytes[worst] / 2**20:.1f} MiB on stage {worst}"
              f" (parameters + activations of its in-flight micro-batches).")
    if smallest > cap:
        raise memory_error(smallest, cap, detail, recomputing=counts.remat_in_flight is not None)
    raise ConfigError(
        "memory.cap_bytes",
        f"{int(cap)} bytes per stage is exceeded: {detail} A split within it exists (the smallest cap any "
        f"split meets is {int(smallest)} bytes): use partitioner=balanced or partitioner=milp.",
    )


def check_schedule_memory(part: Partition, schedule: Schedule, cap: float | None) -> None:
    """Re-price each stage with the final schedule's counts and record them; over the budget is an
    error. The split was cut for the schedule's unit-cost order; a cost-aware order (zbv, zb_h2,
    hanayo on a measured profile) may hold its micro-batches on other stages."""
    held, full = schedule.peak_in_flight(held=True), schedule.peak_in_flight()
    part.reprice(held, full, schedule.remat_stages())
    if cap is None or max(part.stage_memory_bytes) <= cap:
        return
    worst = max(range(len(held)), key=lambda s: part.stage_memory_bytes[s])
    raise ConfigError(
        "memory.cap_bytes",
        f"{int(cap)} bytes per stage is exceeded: scheduler {schedule.name!r} holds {held[worst]} micro-batches "
        f"on stage {worst}, {full[worst]} of them with full activations ({int(part.stage_memory_bytes[worst])} bytes "
        f"with its parameters). Raise the cap; for a scheduler that orders its actions on the measured costs "
        f"(zbv, zb_h2, hanayo), scheduler.cost_aware=false keeps the unit-cost order the split was cut for.",
    )


def build_plan(
    spec: ModelSpec,
    generator: ScheduleGenerator,
    *,
    pp: int,
    dp: int,
    microbatches: int,
    batch_size: int,
    placement_cfg: dict,
    partitioner_cfg: dict,
    remat: str = "none",
    block_costs: Sequence[BlockCost] | None = None,
    bandwidth: float = 1e9,
) -> Plan:
    """Place, partition and schedule: a pure function of the config, the model and its profile."""
    placement = resolve_placement(placement_cfg, generator, pp)
    generator.check(pp, microbatches, list(placement))  # schedule rules first: clearer than a split error
    counts = in_flight_counts(generator, placement, microbatches, remat, partitioner_cfg.get("memory_cap_bytes"))
    blocks, partition = partition_blocks(partitioner_cfg, spec, placement, block_costs, bandwidth, counts)
    if block_costs is not None:
        by_name = {b.name: b for b in block_costs}
        forward = [sum(by_name[n].forward_s for n in names) for names in blocks]
        backward = [sum(by_name[n].backward_s for n in names) for names in blocks]
        generator.use_stage_costs(forward, *split_backward_cost(backward))
    remat_stages = partition.remat_stages if partition is not None else []
    schedule = build_schedule(generator, placement, microbatches, remat, remat_stages)
    if partition is not None:
        check_schedule_memory(partition, schedule, partitioner_cfg.get("memory_cap_bytes"))
    mbs = batch_size // (dp * microbatches)
    shapes = stage_boundary_shapes(spec, blocks, mbs)
    stages = chain_stages(placement, blocks, shapes)
    schedule = lower(schedule, [(p, s.index) for s in stages for p in s.inputs.values() if p is not None])
    meta: dict = {"remat": remat, "remat_stages": schedule.remat_stages(),
                  "partitioner": partitioner_cfg.get("name", "uniform")}
    if partition is not None:
        meta["partition"] = partition_summary(partition)
    if block_costs is not None:
        meta["stage_forward_s"], meta["stage_backward_s"] = forward, backward
    return Plan(pp, dp, microbatches, mbs, spec.name, stages, schedule, meta=meta)


def split_backward_cost(backward_s: Sequence[float], weight_share: float = 0.5) -> tuple[list[float], list[float]]:
    """(I, W) per stage from measured backward times. Stage 0 reads only the data, so it has no
    input gradient: its I is free and its W is the whole backward."""
    w = [b * weight_share for b in backward_s]
    i = [b - x for b, x in zip(backward_s, w, strict=True)]
    if backward_s:
        i[0], w[0] = 0.0, float(backward_s[0])
    return i, w


def partition_summary(partition: Partition) -> dict:
    return {
        "bottleneck_s": partition.bottleneck_s,
        "lower_bound_s": partition.lower_bound_s,
        "stage_time_s": partition.stage_time_s,
        "stage_compute_s": partition.stage_compute_s,
        "stage_param_bytes": partition.stage_param_bytes,
        "stage_activation_bytes": partition.stage_activation_bytes,
        "stage_comm_bytes": partition.stage_comm_bytes,
        "stage_memory_bytes": partition.stage_memory_bytes,
        "stage_in_flight": partition.stage_in_flight,
        "stage_full_in_flight": partition.stage_full_in_flight,
        "stage_input_bytes": partition.stage_input_bytes,
        "remat_stages": partition.remat_stages,
    }


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def chain_stages(
    placement: Sequence[int], blocks: Sequence[Sequence[str]], shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]
) -> list[StagePlan]:
    """Stages of a sequential model: stage s reads `act{s-1}` and writes `act{s}`; the last
    stage's output (`output`) is what the loss is taken on."""
    last = len(blocks) - 1
    stages = []
    for i, (shape, dtype) in enumerate(shapes):
        out = "output" if i == last else f"act{i}"
        stages.append(StagePlan(
            index=i,
            rank=placement[i],
            blocks=list(blocks[i]),
            inputs={"input": None} if i == 0 else {f"act{i - 1}": i - 1},
            outputs={} if i == last else {out: [i + 1]},
            values={out: [list(shape), dtype_name(dtype)]} | ({} if i == 0 else {f"act{i - 1}": [
                list(shapes[i - 1][0]), dtype_name(shapes[i - 1][1])]}),
            loss_value="output" if i == last else None,
        ))
    return stages
