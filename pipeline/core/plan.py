"""The Plan: everything a rank needs to know before it runs, as plain data with a JSON form.

Built once by the planner (in the launcher before spawning, or by rank 0 when joining), written as
plan.json in the run directory and handed to every rank. It holds data only: the planner
(`pipelaunch.pipeline.planner`) makes it, the report (`pipelaunch.pipeline.report`) prints it, and a rank builds its own
stages from it (`pipelaunch.pipeline.runtime.stage`) without importing any planning code.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from pipelaunch.pipeline.core.ir import Schedule
from pipelaunch.pipeline.core.layout import Layout
from pipelaunch.pipeline.core.plan_records import (
    DeviceMemory,
    MachineFacts,
    PartitionSummary,
    PlannedStep,
    SearchSummary,
    UnitCost,
    known_fields,
)


@dataclass(frozen=True)
class StagePlan:
    """One stage: where it runs, what it holds, and the named values it reads and writes.

    `inputs[name]` is the producing stage (None: the model input from the data); `outputs[name]`
    lists the later stages that read it. `values[name]` = [shape, dtype] of one micro-batch, for
    every value crossing a stage boundary. `loss_value` names the model output the loss is taken
    on (last stage only). `recompute` names call_module nodes of this stage (leaf modules) whose
    forward is run again in the backward instead of keeping their saved activations: memory for
    time, chosen per layer (`pipelaunch.pipeline.planner.passes.remat`), unlike an `R` action, which recomputes the
    whole stage.
    """

    index: int
    rank: int  # pipeline rank (0..pp-1) within each data-parallel replica
    blocks: list[str]  # the traced graph's nodes it runs (a chain's blocks are its leaf modules)
    inputs: dict[str, int | None]
    outputs: dict[str, list[int]]
    values: dict[str, list]
    loss_value: str | None = None
    recompute: list[str] = field(default_factory=list)
    #: blocks recomputed under the selective policy (the matmuls' outputs kept, the rest rerun:
    #: pipeline/compute/selective.py); `recompute` names those recomputed whole
    selective: list[str] = field(default_factory=list)
    #: under tp > 1, the boundary values every tp rank holds whole and equal -> tp: each rank sends
    #: 1/tp of it to its counterpart and the receiving tp ranks all-gather it (Megatron's
    #: scatter-gather, SC21 section 4.1), its gradient the same way back
    scatter: dict[str, int] = field(default_factory=dict)
    #: under sequence parallelism, the boundary values each tp rank holds 1/tp of the positions of
    #: -> the sequence dimension (their `values` shapes are one rank's part); and the values each
    #: holds its own slice of (a cut inside a split region)
    sequence: dict[str, int] = field(default_factory=dict)
    split: list[str] = field(default_factory=list)
    #: data.buckets: per length a micro-batch may run at, the shape of each of `values` at it
    #: (pipeline/planner/lengths.py); {}: every micro-batch at model.seq_len
    lengths: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    #: nodes of other stages this stage computes again from the model inputs rather than receive:
    #: values derived from the inputs alone (masks, rotary tables, position ids; graph/derived.py)
    rebuilt: list[str] = field(default_factory=list)

    def value_bytes(self, name: str) -> int:
        shape, dtype = self.values[name]
        n = 1
        for d in shape:
            n *= int(d)
        return n * torch.empty((), dtype=dtype_of(dtype)).element_size()

    def wire_bytes(self, name: str) -> int:
        """Bytes one rank sends of `name` per micro-batch: its 1/tp when scattered."""
        return self.value_bytes(name) // self.scatter.get(name, 1)

    @property
    def send_bytes(self) -> int:
        """Bytes this stage sends per micro-batch (one message per consuming stage)."""
        return sum(self.wire_bytes(n) * len(c) for n, c in self.outputs.items())

    @property
    def recv_bytes(self) -> int:
        return sum(self.wire_bytes(n) for n, p in self.inputs.items() if p is not None)


#: stands for one rank's actions while plan.json is indented (`Plan.write`)
_ROW = "@@plan.json row "


#: plan.json keeps the machine facts flat in `meta`, each group after the key it has always followed
_MACHINE_AFTER = {"model_param_bytes": ("rank_slots", "optimizer_s_per_byte", "optimizer_temporaries"),
                  "stage_largest_param_bytes": ("link_latency_s", "action_overhead_s", "cost_source", "dp_link")}


@dataclass(frozen=True)
class PlanMeta:
    """What the planner decided, measured and predicted besides the stages and schedules; the
    runtime, the report and the prediction read it. Per-stage lists are indexed by stage."""

    remat: str = "none"
    #: the partitioner option and its split, priced by the one judge (`partition.evaluate`)
    partitioner: str = ""
    partition: PartitionSummary | None = None
    precision: str = "fp32"
    #: the data-parallel sharding level the runtime applies (TrainConfig.zero; docs/sharding.md)
    zero: int = 0
    #: the replicas a sharded tensor is split over (hybrid sharding: the groups of them replicate);
    #: None: all dp
    dp_shard: int | None = None
    #: zero=3: when a block's gathered parameters are released, `use` (after each forward or
    #: backward of it) or `run` (after the stage's run of consecutive actions; docs/sharding.md)
    reshard: str = "use"
    #: the device type the plan runs on (`cpu`, `cuda`): on a GPU FSDP2 keeps each stage's last
    #: reduce-scatter input until its next, which the memory model prices
    device_type: str = "cpu"
    #: consecutive units join until one holds this many bytes (`dp_bucket_bytes`; None: one a block)
    bucket_bytes: float | None = None
    #: per stage, its units in forward order (the root unit last when it holds any): what the
    #: data-parallel collectives move together and how long each part of an action takes
    stage_units: list[list[UnitCost]] | None = None
    #: the graph carried measured costs (the stage_*_s lists below are filled)
    profiled: bool = False
    optimizer_states: int = 0
    memory_cap: float | None = None
    reserve_bytes: float = 0.0
    #: stages that recompute entirely (`R` actions)
    remat_stages: list[int] = field(default_factory=list)
    #: per stage, the model's parameter and buffer names it holds (checkpoints by name)
    stage_tensors: list[list[str]] = field(default_factory=list)
    model_param_bytes: int = 0
    #: the machine the plan was made for: core slots, optimizer and runtime overheads
    machine: MachineFacts = field(default_factory=MachineFacts)
    #: per stage its largest parameter tensor (the update's temporaries scale with it)
    stage_largest_param_bytes: list[float] | None = None
    #: per stage, the bytes of its parameters other stages hold too (tied weights), which every
    #: sharding level keeps whole (`predict.memory.Sharding`); None in a plan.json before it
    stage_replicated_param_bytes: list[float] | None = None
    #: under ep > 1, per stage its share of the routed experts' parameter bytes: whole at every
    #: sharding level, reduced over the dp / ep replicas holding the same experts
    stage_expert_param_bytes: list[float] | None = None
    #: under ep > 1, per stage the seconds of its MoE layers' all-to-alls in one micro-batch's
    #: forward and backward (dispatch and combine each way, in its costs: measure/experts.py)
    stage_exchange_s: list[float] | None = None
    #: profiled per-stage costs: forward, backward, its input and weight halves; a backward's
    #: transient gradients; what a split backward keeps from I to W; the loss's saved tensors
    stage_forward_s: list[float] = field(default_factory=list)
    stage_backward_s: list[float] = field(default_factory=list)
    stage_backward_input_s: list[float] = field(default_factory=list)
    stage_backward_weight_s: list[float] = field(default_factory=list)
    stage_workspace_bytes: list[float] | None = None
    stage_weight_stash_bytes: list[float] | None = None
    stage_loss_activation_bytes: list[float] | None = None
    #: blocks recomputed per stage (whole, and under the selective policy), their added time, their buffer
    recompute: dict[str, list[str]] = field(default_factory=dict)
    selective: dict[str, list[str]] = field(default_factory=dict)
    stage_recompute_s: list[float] | None = None
    stage_recompute_region_bytes: list[float] | None = None
    #: the prediction of the plan as run: each pipeline rank's memory, and the step
    device_memory: list[DeviceMemory] | None = None
    prediction: PlannedStep | None = None
    #: plan=auto / scheduler=auto: what was compared, what was chosen and why
    search: SearchSummary | None = None

    def to_json(self) -> dict:
        """plan.json's `meta`: the records as nested objects, the machine facts flat, in the key
        order plan.json has always had (a missing partition is an empty object)."""
        data = asdict(self)
        machine = data.pop("machine")
        data["partition"] = data["partition"] or {}
        if self.device_memory is not None:  # with each device's total, which asdict leaves out
            data["device_memory"] = [d.to_dict() for d in self.device_memory]
        out: dict = {}
        for key, value in data.items():
            out[key] = value
            out.update({k: machine[k] for k in _MACHINE_AFTER.get(key, ())})
        return out

    @classmethod
    def from_json(cls, data: dict) -> PlanMeta:
        """The inverse of `to_json`; known keys only (a plan.json from another version loads)."""
        machine = {k: data[k] for k in (f.name for f in fields(MachineFacts)) if k in data}
        flat = known_fields(cls, data)
        devices = data.get("device_memory")
        return replace(
            flat, machine=MachineFacts(**machine), partition=PartitionSummary.from_json(data.get("partition")),
            device_memory=[known_fields(DeviceMemory, d) for d in devices] if devices is not None else None,
            stage_units=[[known_fields(UnitCost, u) for u in units] for units in data["stage_units"]]
            if data.get("stage_units") is not None else None,
            prediction=known_fields(PlannedStep, data["prediction"]) if data.get("prediction") else None,
            search=known_fields(SearchSummary, data["search"]) if data.get("search") else None)


@dataclass(frozen=True)
class Plan:
    pp: int
    dp: int
    microbatches: int
    micro_batch_size: int
    model: str
    stages: list[StagePlan]
    schedule: Schedule
    #: traced node -> stage: how a rank cuts the model it traced into stage modules
    assignment: dict[str, int] = field(default_factory=dict)
    #: parameter held by several stages (tied weights) -> those stages
    shared_params: dict[str, list[int]] = field(default_factory=dict)
    meta: PlanMeta = field(default_factory=PlanMeta)
    #: the forward-only program for the same stages and placement (evaluation: `eval.every`)
    eval_schedule: Schedule | None = None
    #: the traced model's inputs (the placeholders a stage reads with producer None) -> what the
    #: data gives each: `input`, `target` (a model computing its own loss) or an extra field of the
    #: batch (`position_ids`: packed documents); empty: all `input`
    model_inputs: dict[str, str] = field(default_factory=dict)
    #: tensor-parallel degree: the ranks each pipeline rank's stages are split over
    tp: int = 1
    #: under tp > 1, module qualified name -> how it is split (colwise, rowwise, vocab, replicate:
    #: pipeline/graph/tensor_parallel.py), the model's plan resolved against its modules
    tp_modules: dict[str, str] = field(default_factory=dict)
    #: Megatron's sequence parallelism between the split regions (TrainConfig.sequence_parallel)
    sequence_parallel: bool = False
    #: expert-parallel degree: the replicas a layer's routed experts are split over
    ep: int = 1
    #: under ep > 1 (moe.overlap): each forward the program follows with another stage's backward
    #: runs beside it, their all-to-alls overlapped (runtime/overlap.py, `overlapped_pairs`)
    moe_overlap: bool = False
    #: context-parallel degree: the ranks each sequence's positions are split over, and how
    #: attention crosses them (TrainConfig.cp, cp_method)
    cp: int = 1
    cp_method: str = "ring"

    @property
    def world_size(self) -> int:
        """The ranks the plan runs on: pp x dp x cp x tp."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def layout(self) -> Layout:
        """The parallel layout as one record (`pipeline/core/layout.py`)."""
        return Layout(pp=self.pp, dp=self.dp, tp=self.tp, cp=self.cp, ep=self.ep, dp_shard=self.meta.dp_shard)

    def data_of(self, value: str) -> str:
        """What the data gives the model input `value`: `input`, `target` or an extra per-token
        field of the batch (`position_ids`: packed documents)."""
        return self.model_inputs.get(value, "input")

    def stages_of(self, pp_rank: int) -> list[StagePlan]:
        return [s for s in self.stages if s.rank == pp_rank]

    def shared_param_ranks(self) -> dict[str, list[int]]:
        """Tied parameter -> the pipeline ranks holding a copy (only those on more than one rank)."""
        out = {}
        for name, stages in self.shared_params.items():
            ranks = sorted({self.stages[s].rank for s in stages})
            if len(ranks) > 1:
                out[name] = ranks
        return out

    def with_recompute(self, full: dict[int, list[str]], selective: dict[int, list[str]] | None = None) -> Plan:
        """This plan with the blocks `full[stage]` recomputed whole inside each stage's backward and
        `selective[stage]` under the selective policy (no others)."""
        selective = selective or {}
        return replace(self, stages=[replace(s, recompute=sorted(full.get(s.index, [])),
                                             selective=sorted(selective.get(s.index, []))) for s in self.stages])

    def to_dict(self) -> dict:
        # not asdict(self): it would deep-copy every Action of both schedules only to drop them
        # (2 s of a pp=64, 128-micro-batch plan)
        data = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
                if f.name not in ("schedule", "eval_schedule", "stages", "meta")}
        data["meta"] = self.meta.to_json()
        data["stages"] = [asdict(s) for s in self.stages]
        data["schedule"] = self.schedule.to_dict()
        data["eval_schedule"] = self.eval_schedule.to_dict() if self.eval_schedule is not None else None
        return data

    def write(self, path: Path) -> None:
        """plan.json, indented, with each rank's actions on one line: readable, and written by
        json's C encoder (an indented dump runs the pure-Python one over every action)."""
        data = self.to_dict()
        rows: list[str] = []
        for key in ("schedule", "eval_schedule"):
            if data.get(key):
                programs = data[key]["actions"]
                for rank, acts in enumerate(programs):
                    programs[rank] = f"{_ROW}{len(rows)}@@"
                    rows.append(json.dumps(acts))
        text = json.dumps(data, indent=1)
        path.write_text(re.sub(f'"{re.escape(_ROW)}(\\d+)@@"', lambda m: rows[int(m.group(1))], text))

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """The inverse of `to_dict` (JSON turns int keys into strings; stage inputs keep theirs)."""
        fields = dict(data)
        fields["stages"] = [StagePlan(**{**s, "lengths": {int(k): v for k, v in s.get("lengths", {}).items()}})
                            for s in data["stages"]]
        fields["meta"] = PlanMeta.from_json(data.get("meta") or {})
        fields["schedule"] = Schedule.from_dict(data["schedule"])
        if data.get("eval_schedule"):
            fields["eval_schedule"] = Schedule.from_dict(data["eval_schedule"])
        return cls(**fields)

    @classmethod
    def read(cls, path: Path) -> Plan:
        return cls.from_dict(json.loads(path.read_text()))


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
