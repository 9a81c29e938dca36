"""Plans and stages for models that are not a chain of blocks: trace, profile, cut, route by name.

The launcher traces the model once (torch.fx, user-named leaf modules kept whole), profiles every
node, lets the chosen partitioner assign nodes to stages, and records the assignment in the Plan.
Each rank re-traces the same model (tracing is deterministic) and cuts it with that assignment,
keeping only its own stage GraphModules. Values that jump over stages (skip connections) travel
directly from producer to consumer; parameters read by several stages (tied weights) are listed
so that their gradients can be summed across the stages holding them.
"""

from __future__ import annotations

import torch
from torch import nn

from models.graph_spec import GraphModelSpec
from pipeline.errors import ConfigError
from pipeline.graph.atomic import contract_unsendable
from pipeline.graph.profile import profile_graph
from pipeline.graph.split import split_model
from pipeline.graph.trace import TracedModel, trace_model
from pipeline.lowering import lower
from pipeline.partition import PARTITIONERS, Partition
from pipeline.plan import (
    Plan,
    StageCounts,
    StagePlan,
    check_memory,
    check_schedule_memory,
    dtype_name,
    in_flight_counts,
    partition_summary,
    reprice_split,
    resolve_placement,
    split_backward_cost,
)
from pipeline.schedules import build_schedule
from pipeline.schedules.base import ScheduleGenerator


class GraphStage(nn.Module):
    """A stage cut out of a traced model: forward(**named values) -> dict of named values."""

    def __init__(self, index: int, gm: torch.fx.GraphModule, aliases: dict[str, str]) -> None:
        super().__init__()
        self.index = index
        self.gm = gm
        self.aliases = aliases

    def forward(self, **values: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.gm(**values)

    def named_model_parameters(self):
        """Parameters under the full model's own (canonical) names: a tied alias maps to its owner."""
        for name, p in self.gm.named_parameters():
            yield self.aliases.get(name, name), p


def example_input(spec: GraphModelSpec, micro_batch_size: int) -> torch.Tensor:
    return spec.example_batch(micro_batch_size)[0]


def trace(spec: GraphModelSpec, seed: int, micro_batch_size: int) -> TracedModel:
    module = spec.build_full(seed)
    return trace_model(module, example_input(spec, micro_batch_size), spec.leaf_modules, name=spec.name)


def partition_graph(
    partitioner_cfg: dict, traced: TracedModel, num_stages: int, bandwidth: float, counts: StageCounts
) -> Partition:
    """Cut the traced graph into stages; `counts` as in plan.partition_blocks."""
    name = partitioner_cfg.get("name", "uniform")
    if name not in PARTITIONERS:
        raise ConfigError("partitioner", f"unknown partitioner {name!r}; valid: {', '.join(PARTITIONERS)}")
    graph = traced.graph
    if num_stages > graph.number_of_nodes():
        raise ConfigError(
            "pp",
            f"{num_stages} pipeline stages need at least {num_stages} graph nodes, but the traced model has "
            f"{graph.number_of_nodes()}; lower pp or trace it finer (fewer leaf modules)",
        )
    cap = partitioner_cfg.get("memory_cap_bytes")
    options: dict = {"bandwidth": bandwidth, "in_flight": counts.in_flight}
    if name == "manual":
        options["split_points"] = list(partitioner_cfg.get("split_points") or [])
    if name == "balanced":
        options.update(memory_cap=cap, **counts.pricing())
    if name == "milp":
        options.update(memory_cap=cap, in_flight=counts.for_milp(name),
                       time_limit=float(partitioner_cfg.get("time_limit_s", 5.0)))
    contraction = contract_unsendable(graph)  # cut only where single tensors cross
    part = PARTITIONERS[name](graph if contraction is None else contraction.graph, num_stages, **options)
    if contraction is not None:
        part.assignment = contraction.expand(part.assignment)
    # every split priced (recomputing stages picked) on the real graph by the one judge
    part = reprice_split(part, graph, bandwidth=bandwidth, memory_cap=cap, **counts.pricing())
    check_memory(part, cap, graph, num_stages, counts, name)
    return part


def _value_meta(traced: TracedModel, name: str) -> list:
    node = next(n for n in traced.gm.graph.nodes if n.name == name)
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        raise ConfigError("model", f"value {name!r} crossing a stage boundary is not a single tensor; "
                                   f"make the module producing it a leaf (model leaf_modules) or move the split")
    return [list(meta.shape), dtype_name(meta.dtype)]


def build_graph_plan(
    spec: GraphModelSpec,
    generator: ScheduleGenerator,
    model_cfg: dict,
    *,
    pp: int,
    dp: int,
    microbatches: int,
    batch_size: int,
    seed: int,
    placement_cfg: dict,
    partitioner_cfg: dict,
    remat: str = "none",
    bandwidth: float = 1e9,
    traced: TracedModel | None = None,
) -> Plan:
    """Trace, profile (cached), partition and split a graph model; schedule it on the placement."""
    placement = resolve_placement(placement_cfg, generator, pp)
    generator.check(pp, microbatches, list(placement))
    mbs = batch_size // (dp * microbatches)
    if traced is None:
        traced = trace(spec, seed, mbs)
        profile_graph(traced, (example_input(spec, mbs),), model_config=model_cfg)
    k = len(placement)
    counts = in_flight_counts(generator, placement, microbatches, remat, partitioner_cfg.get("memory_cap_bytes"))
    part = partition_graph(partitioner_cfg, traced, k, bandwidth, counts)
    forward = [0.0] * k
    backward = [0.0] * k
    for node, s in part.assignment.items():
        forward[s] += traced.graph.nodes[node].get("forward_s", 0.0)
        backward[s] += traced.graph.nodes[node].get("backward_s", 0.0)
    generator.use_stage_costs(forward, *split_backward_cost(backward))
    schedule = build_schedule(generator, placement, microbatches, remat, part.remat_stages)
    check_schedule_memory(part, schedule, partitioner_cfg.get("memory_cap_bytes"))
    split = split_model(traced, part.assignment, k)
    outputs = [v for v, s in split.model_outputs.items()]
    if len(outputs) != 1 or split.model_outputs[outputs[0]] != k - 1:
        raise ConfigError(
            "partitioner",
            f"the model output {outputs} must be produced by the last stage ({k - 1}), but the partition puts it "
            f"in stage(s) {list(split.model_outputs.values())}",
        )
    stages = []
    for io in split.io:
        crossing = [n for n, p in io.inputs.items() if p is not None] + list(io.outputs)
        inputs = dict(io.inputs)
        if any(p is None for p in inputs.values()) and len(split.input_names) != 1:
            raise ConfigError("model", f"graph models must take one input tensor, got {split.input_names}")
        stages.append(StagePlan(
            index=io.index,
            rank=placement[io.index],
            blocks=[n for n, s in part.assignment.items() if s == io.index],
            inputs=inputs,
            outputs={n: list(c) for n, c in io.outputs.items() if c},
            values={n: _value_meta(traced, n) for n in crossing},
            loss_value=outputs[0] if io.index == k - 1 else None,
        ))
    schedule = lower(schedule, [(p, s.index) for s in stages for p in s.inputs.values() if p is not None])
    meta = {
        "remat": remat,
        "remat_stages": schedule.remat_stages(),
        "partitioner": partitioner_cfg.get("name", "uniform"),
        "partition": partition_summary(part),
        "assignment": dict(part.assignment),
        "stage_forward_s": forward,
        "stage_backward_s": backward,
        "shared_params": {k_: list(v) for k_, v in split.shared_params.items()},
    }
    return Plan(pp, dp, microbatches, mbs, spec.name, stages, schedule, meta=meta)


def build_graph_stages(
    spec: GraphModelSpec, plan: Plan, pp_rank: int, seed: int, device: torch.device
) -> dict[int, nn.Module]:
    """This rank's stage modules: re-trace, cut with the plan's assignment, keep own stages.

    Tracing needs the whole model, built on the CPU; only this rank's stages move to `device`.
    Stages of one rank that share a parameter share the very same tensor.
    """
    traced = trace(spec, seed, plan.micro_batch_size)
    split = split_model(traced, plan.meta["assignment"], len(plan.stages))
    own = [s.index for s in plan.stages_of(pp_rank)]
    return {i: GraphStage(i, split.stages[i], dict(split.param_aliases)).to(device) for i in own}


def shared_param_ranks(plan: Plan) -> dict[str, list[int]]:
    """Tied parameter -> the pipeline ranks holding a copy (more than one rank only)."""
    out = {}
    for name, stages in plan.meta.get("shared_params", {}).items():
        ranks = sorted({plan.stages[s].rank for s in stages})
        if len(ranks) > 1:
            out[name] = ranks
    return out
