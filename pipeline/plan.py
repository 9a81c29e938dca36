"""The Plan: everything a rank needs to know before it runs, as one serialisable object.

Built once (by the launcher before spawning, or by rank 0 when joining), written as plan.json in
the run directory, and handed to every rank; planning is pure, execution is not.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from models.base import ModelSpec
from pipeline.errors import ConfigError
from pipeline.ir import Schedule
from pipeline.lowering import lower
from pipeline.placement import check_explicit, from_kind
from pipeline.schedules import build_schedule
from pipeline.schedules.base import ScheduleGenerator
from pipeline.stages import split_manual, split_uniform, stage_boundary_shapes


@dataclass
class StagePlan:
    index: int
    rank: int  # pipeline rank (0..pp-1) within each data-parallel replica
    blocks: list[str]
    output_shape: list[int]
    output_dtype: str


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

    def to_dict(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "schedule"}
        data["schedule"] = self.schedule.to_dict()
        return data

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1))

    def stage_table(self) -> str:
        lines = [f"{'stage':>5} {'rank':>4}  blocks"]
        for s in self.stages:
            lines.append(f"{s.index:>5} {s.rank:>4}  {', '.join(s.blocks)}")
        return "\n".join(lines)


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


def partition_blocks(partitioner_cfg: dict, spec: ModelSpec, num_stages: int) -> list[list[str]]:
    name = partitioner_cfg.get("name", "uniform")
    if name == "uniform":
        return split_uniform(spec.block_names, num_stages)
    if name == "manual":
        return split_manual(spec.block_names, list(partitioner_cfg.get("split_points") or []), num_stages)
    raise ConfigError("partitioner", f"unknown partitioner {name!r}; valid: uniform, manual")


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
) -> Plan:
    """Place, partition and schedule: a pure function of the config and the model description."""
    placement = resolve_placement(placement_cfg, generator, pp)
    schedule = lower(build_schedule(generator, placement, microbatches, remat))
    blocks = partition_blocks(partitioner_cfg, spec, len(placement))
    mbs = batch_size // (dp * microbatches)
    shapes = stage_boundary_shapes(spec, blocks, mbs)
    stages = [
        StagePlan(i, placement[i], blocks[i], list(shape), str(dtype).removeprefix("torch."))
        for i, (shape, dtype) in enumerate(shapes)
    ]
    return Plan(pp, dp, microbatches, mbs, spec.name, stages, schedule, meta={"remat": remat})


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)
