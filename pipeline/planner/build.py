"""One Plan from one request, for every model: place -> count in-flight micro-batches -> partition
-> price stages -> schedule -> passes (recompute, fuse, lower) -> Plan.

Pure functions of (config, traced graph, profile): no process, no real weights. A chain of blocks
and a U-Net go through the same steps; only their graphs differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import networkx as nx
import torch

from pipelaunch.pipeline.core.config import LINK_BANDWIDTH, LINK_LATENCY_S
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan import Plan, PlanMeta, StagePlan, dtype_name
from pipelaunch.pipeline.core.plan_records import MachineFacts, PartitionSummary, UnitCost
from pipelaunch.pipeline.core.plugins import Plugin
from pipelaunch.pipeline.graph.derived import rebuilt_forward_s
from pipelaunch.pipeline.graph.sequence_parallel import REPLICATED, SEQUENCE, SPLIT
from pipelaunch.pipeline.graph.split import split_model
from pipelaunch.pipeline.graph.trace import TracedModel
from pipelaunch.pipeline.graph.units import node_param_uses, stage_units
from pipelaunch.pipeline.planner.fit.budget import (
    device_view,
    partition_request,
    reprice_for_schedule,
    reprice_split,
    stage_param_factors,
)
from pipelaunch.pipeline.planner.measure.tensor_parallel import all_gather_s
from pipelaunch.pipeline.planner.partition import Partition, PartitionRequest, evaluate
from pipelaunch.pipeline.planner.partition.atomic import contract_unsendable
from pipelaunch.pipeline.planner.partition.common import assignment_from_order, topo_order
from pipelaunch.pipeline.planner.partition.rank_balance import rank_balanced_starts
from pipelaunch.pipeline.planner.passes.data_parallel import place_data_parallel
from pipelaunch.pipeline.planner.passes.lowering import lower
from pipelaunch.pipeline.planner.passes.p2p_check import edge_messages
from pipelaunch.pipeline.planner.passes.remat import (
    apply_recompute,
    every_block,
    per_block_suffices,
    recompute_effect,
    recompute_options,
    recomputed_view,
)
from pipelaunch.pipeline.planner.predict.costs import split_backward_cost, stage_held_bytes
from pipelaunch.pipeline.planner.predict.memory import Sharding
from pipelaunch.pipeline.planner.schedules import build_schedule
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts, ScheduleGenerator
from pipelaunch.pipeline.planner.schedules.inference import Inference
from pipelaunch.pipeline.planner.schedules.weight_fill import StageMemory


def resolve_placement(placement: Plugin, generator: ScheduleGenerator, pp: int) -> list[int]:
    """Stage -> pipeline rank, from the placement plug-in: `fn(pp, schedule, **options)`."""
    try:
        return [int(r) for r in placement(pp, generator)]
    except TypeError as err:
        raise ConfigError("placement", f"{placement.path} cannot be called as "
                                       f"placement(pp, schedule, **{dict(placement.kwargs)}): {err}") from None


def needs_profile(partitioner: Plugin) -> bool:
    """Whether the partitioner reads measured costs (those that do not set `needs_profile = False`)."""
    return bool(partitioner.attribute("needs_profile", True))


def partition_graph(
    partitioner: Plugin, graph: nx.DiGraph, placement: Sequence[int], request: PartitionRequest,
    param_factor: float = 1.0, shared_factor: float | None = None, cut_view: nx.DiGraph | None = None,
) -> Partition:
    """Cut the traced graph into stages with the partitioner plug-in, then price the split with the
    one judge (`evaluate`), recomputing stages picked, on the real graph. Values that are not one
    tensor never cross a boundary (the graph is contracted first). When a rank holds several
    stages, a profiled split is re-balanced so that the busiest rank, not only the slowest stage,
    is as light as it can be. Under a memory cap the partitioner sees every parameter byte
    `param_factor` times (gradient and optimizer state too), a parameter several nodes read
    `shared_factor` times (`budget.device_view`, `budget.stage_param_factors`). `cut_view`: the
    graph the partitioner cuts in its place (every block recomputed: `remat.recomputed_view`);
    the split is priced on `graph` either way."""
    num_stages = len(placement)
    if num_stages > graph.number_of_nodes():
        raise ConfigError(
            "pp",
            f"{num_stages} pipeline stages need at least {num_stages} graph nodes (blocks), but the traced model "
            f"has {graph.number_of_nodes()} ({', '.join(list(graph.nodes)[:12])}); lower pp, use a schedule "
            f"with fewer stages per rank, or a model with more layers (e.g. model.layers), or model.granularity=op",
        )
    contraction = contract_unsendable(cut_view if cut_view is not None else graph)  # cut where single tensors cross
    cut_graph = (cut_view if cut_view is not None else graph) if contraction is None else contraction.graph
    if request.memory_cap is not None:
        cut_graph = device_view(cut_graph, param_factor, shared_factor)
    part = partitioner(cut_graph, num_stages, request)
    if not isinstance(part, Partition):
        raise ConfigError("partitioner", f"{partitioner.path} returned {type(part).__name__}, "
                                         f"not a pipelaunch.pipeline.planner.partition.Partition")
    if len(set(placement)) < num_stages and needs_profile(partitioner):
        part = _rank_balanced(part, cut_graph, placement, request)
    if contraction is not None:
        part.assignment = contraction.expand(part.assignment)
    return reprice_split(part, graph, **request.pricing())


def _rank_balanced(part: Partition, graph: nx.DiGraph, placement: Sequence[int], request: PartitionRequest) -> Partition:
    """Move the boundaries of a contiguous split while the busiest rank gets lighter; kept only
    within the memory cap (the stage-balanced split is the one that fits otherwise)."""
    order = topo_order(graph)
    stages = [part.assignment[n] for n in order]
    if stages != sorted(stages):  # not contiguous in program order (a MILP DAG split): leave it
        return part
    starts = [stages.index(s) for s in range(part.num_stages)]
    costs = [float(graph.nodes[n].get("forward_s", 0.0)) + float(graph.nodes[n].get("backward_s", 0.0))
             for n in order]
    starts = rank_balanced_starts(costs, starts, placement)
    rebalanced = evaluate(graph, assignment_from_order(order, starts), part.num_stages,
                          method=f"{part.method}+ranks", **request.pricing())
    cap = request.memory_cap
    if cap is not None and max(rebalanced.stage_memory_bytes) > cap:
        return part
    rebalanced.info = dict(part.info)
    return rebalanced


@dataclass(frozen=True)
class PlanRequest:
    """What one Plan is built for: the run's shape and the options of its plug-ins. `profiled`:
    the traced graph carries measured costs. `value_dtypes`: under bf16, the dtype autocast gives
    each value on the run's device type (a sender's output, so what its receiver allocates).
    `rank_slots` and `optimizer_s_per_byte` are this machine's facts the prediction reads."""

    model_name: str
    pp: int
    dp: int
    microbatches: int
    batch_size: int
    placement: Plugin
    partitioner: Plugin
    remat: str = "none"
    memory_cap: float | None = None
    #: what a device holds beyond the model's tensors, left out of the cap by the partitioners
    reserve_bytes: float = 0.0
    #: optimizer tensors per parameter (pipelaunch.pipeline.planner.predict.memory)
    optimizer_states: int = 0
    bandwidth: float = LINK_BANDWIDTH
    profiled: bool = True
    precision: str = "fp32"
    #: the data-parallel sharding level and the replicas a sharded tensor spans (TrainConfig.zero,
    #: dp_shard; None: all dp)
    zero: int = 0
    dp_shard: int | None = None
    #: zero=3: when a unit's gathered parameters are released (TrainConfig.reshard)
    reshard: str = "use"
    #: the device type the run trains on (`cuda` for a GPU run)
    device_type: str = "cpu"
    #: consecutive units join until one holds this many bytes (TrainConfig.dp_bucket_bytes)
    bucket_bytes: float | None = None
    #: what the data gives each input of the traced model, in order (`ModelSpec.data_args`)
    data_args: tuple[str, ...] = ("input",)
    value_dtypes: Mapping[str, torch.dtype] | None = None
    rank_slots: float | None = None
    optimizer_s_per_byte: float = 0.0
    optimizer_temporaries: tuple[float, float] = (0.0, 0.0)
    link_latency_s: float = LINK_LATENCY_S
    action_overhead_s: float = 0.0
    #: whether the run evaluates (eval.every > 0): only then is the forward-only program built
    evaluates: bool = True
    #: under remat=auto, the stages that recompute whole (`R` actions) in place of the partition's
    #: choice (`fit.fit_budget` asks for them where recomputing modules cannot meet the cap)
    whole_stages: tuple[int, ...] | None = None
    #: tensor-parallel degree and the modules it splits (TrainConfig.tp; the model's plan resolved)
    tp: int = 1
    tp_modules: Mapping[str, str] = field(default_factory=dict)
    sequence_parallel: bool = False
    #: expert-parallel degree (TrainConfig.ep)
    ep: int = 1
    #: moe.overlap: DualPipeV's forward-backward pairs overlap their all-to-alls (ep > 1)
    moe_overlap: bool = False
    #: context-parallel degree and method (TrainConfig.cp, cp_method)
    cp: int = 1
    cp_method: str = "ring"
    #: where the costs come from (MachineFacts.cost_source)
    cost_source: str | None = None
    #: the replicas' link (latency, bandwidth) when not the pipeline's (`Hardware.links`)
    dp_link: tuple[float, float] | None = None


def _value_meta(traced: TracedModel, name: str, dtypes: Mapping[str, torch.dtype] | None, tp: int = 1) -> list:
    node = next(n for n in traced.gm.graph.nodes if n.name == name)
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        raise ConfigError("model", f"value {name!r} crossing a stage boundary is not a single tensor; "
                                   f"make the module producing it a leaf (model leaf_modules) or move the split")
    dtype = meta.dtype if dtypes is None else dtypes.get(name, meta.dtype)
    shape = list(meta.shape)
    kind, dim = _layout(traced, name)
    if kind == SEQUENCE:  # one tp rank's positions
        shape[dim] //= tp
    return [shape, dtype_name(dtype)]


def build_plan(traced: TracedModel, generator: ScheduleGenerator, req: PlanRequest) -> Plan:
    """Place, count, partition, price, schedule and lower: a pure function of the request and the
    traced (and, when `req.profiled`, measured) graph."""
    placement = resolve_placement(req.placement, generator, req.pp)
    generator.check(req.pp, req.microbatches, list(placement))  # schedule rules first: clearer than a split error
    part = _partition(traced, generator, placement, req)
    split = split_model(traced, part.assignment, len(placement), lazy=True)  # its stages never run here
    inputs = model_inputs(split.input_names, req.data_args)
    stages = _stage_plans(traced, split, part, placement, req.value_dtypes, req.tp)
    forward, backward, split_costs = _stage_costs(traced, part, len(placement), req.profiled)
    forward = [f + r for f, r in zip(forward, rebuilt_forward_s(traced.graph, [s.rebuilt for s in stages]),
                                     strict=True)]
    if req.profiled and req.tp > 1:
        _price_gathers(stages, placement, forward, backward, split_costs[0], req.tp, traced.graph.graph["tp_link"])
    blocks = _every_block(traced, part, req, generator)
    plain_act = list(part.stage_activation_bytes)
    rerun = [0.0] * len(placement)
    if blocks is not None:  # remat=full / selective: every block reruns inside the stage's backward
        part.stage_activation_bytes, rerun, _ = recompute_effect(blocks, plain_act, len(placement))
    held = _held_beyond_activations(traced, stages) if req.profiled else None
    costs = None
    if held is not None:  # as the prediction prices them: the runtime's fixed cost on every action
        fixed = req.action_overhead_s
        # a recomputed block reruns in a fused backward once, in each half of a split one (but stage 0's I)
        halves = [[x + fixed + (r if s > 0 or half else 0.0) for s, (x, r) in enumerate(zip(xs, rerun, strict=True))]
                  for half, xs in enumerate(split_costs)]
        costs = ScheduleCosts.of([f + fixed for f in forward], *halves,
                                 backward=[b + r + fixed for b, r in zip(backward, rerun, strict=True)],
                                 hop=_hops(part, placement, req, stages), memory=_stage_memory(stages, part, *held))
    schedule = build_schedule(generator, placement, req.microbatches, req.remat, _whole_stages(traced, part, req),
                              costs)
    reprice_for_schedule(part, schedule)
    messages = edge_messages(stages)
    # gradients flow back only along edges carrying a floating-point value
    schedule = lower(schedule, messages, grad_edges=[e for e, (_, grads) in messages.items() if grads])
    # the replicas' collectives: gathers, releases and gradient reductions where the program allows
    schedule = place_data_parallel(schedule, req.zero, req.dp * req.cp)  # cp ranks sum their gradients too
    # evaluation runs the same stages on the same ranks, forward only (a pp=64 plan of 256
    # micro-batches spends about 0.3 s lowering and checking it: not for a run that never evaluates)
    eval_schedule = lower(build_schedule(Inference(), placement, req.microbatches), messages) \
        if req.evaluates else None
    if blocks is not None:
        part.stage_activation_bytes = plain_act  # the plan records the plain ones, less the choice below
    meta = _plan_meta(traced, split, part, stages, req, schedule)
    if held is not None:
        meta.update(_profiled_meta(traced, stages, forward, backward, split_costs, *held))
    plan = Plan(req.pp, req.dp, req.microbatches, req.batch_size // (req.dp * req.microbatches), req.model_name,
                stages, schedule, assignment=dict(part.assignment),
                shared_params={n: list(v) for n, v in split.shared_params.items()}, meta=PlanMeta(**meta),
                eval_schedule=eval_schedule, model_inputs=inputs, tp=req.tp, tp_modules=dict(req.tp_modules),
                sequence_parallel=req.sequence_parallel, ep=req.ep,
                moe_overlap=req.moe_overlap and req.ep > 1, cp=req.cp, cp_method=req.cp_method)
    return plan if blocks is None else apply_recompute(plan, traced.graph, blocks, plain_act)


def _every_block(traced: TracedModel, part: Partition, req: PlanRequest, generator: ScheduleGenerator):
    """remat=full / selective: every block of every stage, recomputed the one way (None otherwise)."""
    if req.remat not in ("full", "selective") or not generator.training:
        return None
    split = set(range(1, part.num_stages)) if generator.split_backward else set()
    options = recompute_options(traced.graph, part.assignment, split, keep_all=True)
    return every_block(options, selective=req.remat == "selective")


def model_inputs(names: Sequence[str], data_args: Sequence[str]) -> dict[str, str]:
    """The traced model's inputs (placeholder names, in call order) -> what the data gives each:
    `input`, `target` for a model that computes its own loss from them, or an extra per-token
    field of the batch (`position_ids` on packed documents), handed to every stage reading it."""
    if len(names) != len(data_args):
        given = " and ".join(f"its {a}s" for a in data_args)
        raise ConfigError("model", f"the traced model takes {len(names)} input(s) {list(names)}, but the data gives it "
                                   f"{len(data_args)} ({given}); a model takes its input tensor (and, with "
                                   "model.loss=model, its targets), other arguments as model.extra_inputs")
    return dict(zip(names, data_args, strict=True))


def _partition(traced: TracedModel, generator: ScheduleGenerator, placement: list[int], req: PlanRequest) -> Partition:
    """The split under the cap, less what every device holds beyond the model's tensors."""
    if req.memory_cap is not None and req.memory_cap <= req.reserve_bytes:
        raise ConfigError("memory.cap_bytes", f"{req.memory_cap:.0f} bytes per device leaves nothing for the model "
                                              f"once memory.reserve_bytes={req.reserve_bytes:.0f} (what a rank holds "
                                              "beyond its tensors) is set aside; raise the cap or lower the reserve")
    stage_cap = None if req.memory_cap is None else req.memory_cap - req.reserve_bytes
    request = partition_request(generator, placement, req.microbatches, req.remat, stage_cap, req.bandwidth)
    try:
        factors = stage_param_factors(req.optimizer_states, Sharding(req.zero, req.dp_shard or req.dp * req.cp, req.precision,
                                                                     req.reshard))
        cut_view = recomputed_view(traced.graph, req.remat == "selective") \
            if req.remat in ("full", "selective") and generator.training else None
        return partition_graph(req.partitioner, traced.graph, placement, request, *factors, cut_view=cut_view)
    except ConfigError as err:
        if err.key != "memory.cap_bytes" or not req.reserve_bytes:
            raise
        raise ConfigError(err.key, f"{str(err).split(': ', 1)[1]} (A stage's bytes above leave out the "
                                   f"memory.reserve_bytes={req.reserve_bytes:.0f} every device also holds: add them "
                                   "to any cap stated here.)") from None


def _price_gathers(stages: list[StagePlan], placement: list[int], forward: list[float], backward: list[float],
                   backward_input: list[float], tp: int, link: tuple[float, float]) -> None:
    """A scattered value's all-gather on the tp link, where the runtime runs it: before the forward
    of the stage receiving it, and before the backward (its input-gradient half) of the stage
    that sent it, which gathers the value's gradient."""
    for stage in stages:
        for name, producer in stage.inputs.items():
            if producer is not None and name in stage.scatter and placement[producer] != stage.rank:
                seconds = all_gather_s(stage.value_bytes(name), tp, *link)
                forward[stage.index] += seconds
                backward[producer] += seconds
                backward_input[producer] += seconds


def _hops(part: Partition, placement: list[int], req: PlanRequest, stages: list[StagePlan]) -> list[float]:
    """Per cut between stages s and s + 1, the time its values take to cross it: the link's latency
    plus their bytes over its bandwidth where the cut joins two ranks, nothing on one rank (under
    tp, what one rank sends: a scattered value's 1/tp)."""
    sent = [s.send_bytes for s in stages] if req.tp > 1 else part.stage_comm_bytes
    return [req.link_latency_s + (sent[s] / req.bandwidth if s < len(sent) and req.bandwidth else 0.0)
            if placement[s] != placement[s + 1] else 0.0 for s in range(len(placement) - 1)]


def _whole_stages(traced: TracedModel, part: Partition, req: PlanRequest) -> list[int]:
    """The stages that recompute whole (R actions): under remat=auto, only those over the cap that
    recomputing chosen blocks would not bring under it (`remat.per_block_suffices`), or those
    the request names."""
    if req.remat == "auto" and req.whole_stages is not None:
        return sorted(req.whole_stages)
    if req.remat != "auto" or not part.remat_stages or req.memory_cap is None:
        return list(part.remat_stages)
    modules = per_block_suffices(traced.graph, part, req.memory_cap - req.reserve_bytes)
    return [s for s in part.remat_stages if s not in modules]


def _stage_costs(traced: TracedModel, part: Partition, k: int, profiled: bool
                 ) -> tuple[list[float], list[float], tuple[list[float], list[float]]]:
    """Per stage: forward, fused backward and (input, weight) halves of the backward, as profiled."""
    forward, backward = [0.0] * k, [0.0] * k
    for node, s in part.assignment.items():
        forward[s] += traced.graph.nodes[node].get("forward_s", 0.0)
        backward[s] += traced.graph.nodes[node].get("backward_s", 0.0)
    split_costs = stage_split_backward(traced, part.assignment, backward) if profiled else ([], [])
    return forward, backward, split_costs


def _stage_plans(traced: TracedModel, split, part: Partition, placement: list[int],
                 dtypes: Mapping[str, torch.dtype] | None, tp: int = 1) -> list[StagePlan]:
    """Each stage: its rank, its nodes, and the named values it reads and writes."""
    k = len(placement)
    outputs = list(split.model_outputs)
    if len(outputs) != 1 or split.model_outputs[outputs[0]] != k - 1:
        raise ConfigError(
            "partitioner",
            f"the model output {outputs} must be produced by the last stage ({k - 1}), but the partition puts it "
            f"in stage(s) {list(split.model_outputs.values())}",
        )
    stages = []
    for io in split.io:
        crossing = [n for n, p in io.inputs.items() if p is not None] + list(io.outputs)
        stages.append(StagePlan(
            index=io.index,
            rank=placement[io.index],
            blocks=[n for n, s in part.assignment.items() if s == io.index],
            inputs=dict(io.inputs),
            outputs={n: list(c) for n, c in io.outputs.items() if c},
            values={n: _value_meta(traced, n, dtypes, tp) for n in crossing},
            loss_value=outputs[0] if io.index == k - 1 else None,
            scatter={n: tp for n in crossing if _scattered(traced, n, tp)},
            sequence={n: d for n in crossing if (d := _layout(traced, n)[1]) is not None},
            split=[n for n in crossing if _layout(traced, n)[0] == SPLIT],
            rebuilt=list(io.rebuilt),
        ))
    return stages


def _layout(traced: TracedModel, name: str) -> tuple[str, int | None]:
    """A value's layout over the tp ranks (measure/traced.py: whole and equal, this rank's positions
    along a dimension, or a slice); whole without tp."""
    return traced.graph.graph.get("tp_layouts", {}).get(name, (REPLICATED, None))


def _scattered(traced: TracedModel, name: str, tp: int) -> bool:
    """Whether a boundary value crosses in 1/tp slices: every tp rank holds it whole and equal
    (`graph.tensor_parallel.replicated_values`), it is floating point (its gradient comes back the
    same way) and tp divides its elements."""
    if tp == 1 or _layout(traced, name)[0] != REPLICATED or "tp_layouts" not in traced.graph.graph:
        return False
    meta = next(n for n in traced.gm.graph.nodes if n.name == name).meta["tensor_meta"]
    return meta.dtype.is_floating_point and meta.shape.numel() % tp == 0


def _plan_meta(traced: TracedModel, split, part: Partition, stages: list[StagePlan], req: PlanRequest,
               schedule) -> dict:
    """What the runtime, the report and the prediction read besides the stages and schedules."""
    return {"remat": req.remat, "optimizer_states": req.optimizer_states, "memory_cap": req.memory_cap,
            "reserve_bytes": req.reserve_bytes, "remat_stages": schedule.remat_stages(),
            "partitioner": req.partitioner.option, "partition": partition_summary(part),
            "profiled": req.profiled, "precision": req.precision, "zero": req.zero, "dp_shard": req.dp_shard,
            "reshard": req.reshard, "device_type": req.device_type,
            "stage_units": unit_costs(traced, split, bucket_bytes(req.bucket_bytes, req.zero)),
            "bucket_bytes": bucket_bytes(req.bucket_bytes, req.zero),
            "machine": MachineFacts(req.rank_slots, req.optimizer_s_per_byte, list(req.optimizer_temporaries),
                                    req.link_latency_s, req.action_overhead_s, req.cost_source,
                                    None if req.dp_link is None else list(req.dp_link)),
            "stage_largest_param_bytes": [max((float(p.numel() * p.element_size()) for p in gm.parameters()),
                                              default=0.0) for gm in split.stages],
            "stage_replicated_param_bytes": _replicated_bytes(traced, split),
            "stage_expert_param_bytes": _expert_bytes(traced, split),
            "stage_exchange_s": _exchange_s(traced, part),
            "model_param_bytes": sum(traced.graph.graph.get("param_sizes", {}).values()),
            "stage_tensors": [sorted({traced.param_aliases.get(n, n) for n, _ in [
                *gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]})
                for gm in split.stages]}


#: zero=0's buckets unless `dp_bucket_bytes` says otherwise: DDP's default (`bucket_cap_mb=25`)
DDP_BUCKET_BYTES = 25e6


def bucket_bytes(given: float | None, zero: int) -> float | None:
    """The bytes consecutive units join up to (graph/units.py rule 6): `dp_bucket_bytes`, 0 for
    one unit per block; left null, DDP's 25 MB at zero=0 (an all-reduce costs a fixed latency per
    hop, and at 3 MB a block gpt_bench measured 3% slower per block than per stage), one unit per
    block at zero >= 1 (FSDP's per-block wrapping: what lowers the peak)."""
    if given is None:
        return DDP_BUCKET_BYTES if zero == 0 else None
    return float(given) or None


def unit_costs(traced: TracedModel, split, bucket_bytes: float | None = None) -> list[list[UnitCost]]:
    """Per stage, its units (graph/units.py: what the runtime gathers, releases and reduces
    together) in forward order, each with its parameter bytes and the profiled time of the nodes in
    its span (0 unprofiled); the root unit last when it holds any."""
    nodes = traced.graph.nodes
    keys = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s")
    out = []
    for gm in split.stages:
        sizes = {n: float(p.numel() * p.element_size()) for n, p in gm.named_parameters(remove_duplicate=False)}
        # tied parameters are reduced apart, and an ep rank's experts too (their own replicas)
        excluded = set(split.shared_params) | set(traced.graph.graph.get("expert_params", ()))
        units = stage_units(node_param_uses(gm), sizes, excluded=excluded, canonical=split.param_aliases,
                            bucket_bytes=bucket_bytes)
        names = [n.name for n in gm.graph.nodes]
        row = []
        for unit in units.units:
            span = [n for n in names[unit.first:unit.last + 1] if n in nodes]
            row.append(UnitCost(unit.name, unit.nbytes, *(float(sum(nodes[n].get(k, 0.0) for n in span)) for k in keys)))
        if units.root:
            row.append(UnitCost("root", units.root_bytes))
        out.append(row)
    return out


def _replicated_bytes(traced: TracedModel, split) -> list[float]:
    """Per stage, the bytes of its parameters that other stages hold too (`split.shared_params`):
    what data-parallel sharding leaves whole."""
    shared = split.shared_params
    return [float(sum(p.numel() * p.element_size() for name, p in gm.named_parameters()
                      if traced.param_aliases.get(name, name) in shared)) for gm in split.stages]


def _expert_bytes(traced: TracedModel, split) -> list[float] | None:
    """Per stage under ep > 1, the bytes of its share of the routed experts (measure/experts.py):
    what no sharding level cuts further and only the expert replicas reduce; None without ep."""
    experts = set(traced.graph.graph.get("expert_params", ()))
    if not experts:
        return None
    return [float(sum(p.numel() * p.element_size() for name, p in gm.named_parameters()
                      if traced.param_aliases.get(name, name) in experts)) for gm in split.stages]


def _exchange_s(traced: TracedModel, part: Partition) -> list[float] | None:
    """Per stage under ep > 1, its MoE layers' all-to-alls in one micro-batch's forward and
    backward, on the link the trace priced them on (`stage_exchange_s`); None without ep."""
    from pipelaunch.pipeline.planner.measure.experts import exchange_s

    g = traced.graph
    ep, link = int(g.graph.get("ep", 1) or 1), g.graph.get("ep_link")
    if ep < 2 or link is None:
        return None
    out = [0.0] * part.num_stages
    for name, stage in part.assignment.items():
        if name in g.nodes:
            out[stage] += exchange_s(g.nodes[name], ep, link)
    return out


def _held_beyond_activations(traced: TracedModel, stages: list[StagePlan]) -> tuple[list[float], list[float]]:
    """Per stage, as profiled: the loss's saved tensors, and what a split backward keeps from its I
    to its W beside the activations (`weight_stash_bytes`)."""
    nodes = traced.graph.nodes
    loss = [sum(float(nodes[n].get("loss_activation_bytes", 0)) for n in s.blocks) for s in stages]
    return loss, [weight_stash_bytes(traced, s) for s in stages]


def _stage_memory(stages: list[StagePlan], part: Partition, loss: list[float], stash: list[float]) -> StageMemory:
    """What one micro-batch holds on each stage, as the prediction prices it (`stage_held_bytes`):
    for schedules whose memory promise is in bytes."""
    act, freed = stage_held_bytes(stages, part.stage_activation_bytes, loss)
    return StageMemory(tuple(act), tuple(a - f + w for a, f, w in zip(act, freed, stash, strict=True)))


def _profiled_meta(traced: TracedModel, stages: list[StagePlan], forward: list[float], backward: list[float],
                   split_costs: tuple[list[float], list[float]], loss: list[float], stash: list[float]) -> dict:
    """The measured per-stage costs the prediction reads."""
    nodes = traced.graph.nodes
    return {
        "stage_forward_s": forward, "stage_backward_s": backward,
        "stage_backward_input_s": split_costs[0], "stage_backward_weight_s": split_costs[1],
        # a backward's transient gradients: its stage's largest node's activations (planner/memory.py),
        # and on the stage taking the loss the gradient of the model output, as large as that output
        "stage_workspace_bytes": [max((float(nodes[n].get("activation_bytes", 0)) for n in s.blocks), default=0.0)
                                  + (s.value_bytes(s.loss_value) if s.loss_value in s.values else 0.0)
                                  for s in stages],
        "stage_weight_stash_bytes": stash,
        "stage_loss_activation_bytes": loss,
    }


def stage_split_backward(traced: TracedModel, assignment: dict[str, int],
                         backward: list[float]) -> tuple[list[float], list[float]]:
    """(I, W) per stage as profiled: each node's split backward summed, which costs more than its
    fused one (`planner/measure/profile.py`). Stage 0 receives no input: its I does nothing and W runs the
    whole backward, at the fused price. A profile without split timings (none of its nodes has
    one) falls back to an even split of the fused backward."""
    nodes = traced.graph.nodes
    if not any("backward_input_s" in nodes[n] for n in assignment):
        return split_backward_cost(backward)
    i, w = [0.0] * len(backward), [0.0] * len(backward)
    for node, s in assignment.items():
        i[s] += float(nodes[node].get("backward_input_s", 0.0))
        w[s] += float(nodes[node].get("backward_weight_s", 0.0))
    if backward:
        i[0], w[0] = 0.0, float(backward[0])
    return i, w


def weight_stash_bytes(traced: TracedModel, stage: StagePlan) -> float:
    """What a stage's split backward keeps per micro-batch from its I to its W beside the saved
    activations: the gradients captured where W restarts, summed over its nodes as profiled. A
    stage that receives no input (the first) has no input gradient to compute: its I does
    nothing and W runs the whole backward from the gradients of its outputs, which it keeps."""
    if any(producer is not None for producer in stage.inputs.values()):
        return sum(float(traced.graph.nodes[n].get("stash_bytes", 0)) for n in stage.blocks)
    return float(sum(stage.value_bytes(n) for n in stage.outputs if n in stage.values))


def partition_summary(partition: Partition) -> PartitionSummary:
    """The split as the plan records it."""
    return PartitionSummary(**{f.name: getattr(partition, f.name) for f in fields(PartitionSummary)})
