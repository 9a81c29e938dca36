"""Everything that runs before ranks exist, behind one entry point: `make_plan`.

From the typed config and the model's spec to the finished Plan: trace on the meta device,
profile when something reads costs, search (`plan=auto`, `scheduler=auto`) or build the one plan
the config names, give boundary values their autocast dtypes, predict each device's memory and
the step, fit the memory budget. What the search compared and why the winner won is part of the
Plan (`meta.search`), as is the prediction (`meta.prediction`, `meta.device_memory`); the Plan is frozen:
nothing edits it once `make_plan` returns it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial

import torch

from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.compute.threads import available_cores, cpu_threads
from pipelaunch.pipeline.core.config import TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.hardware import Hardware, configured_hardware
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.core.plan_records import PlannedStep, SearchSummary
from pipelaunch.pipeline.core.plugins import GroupOptions, Plugins
from pipelaunch.pipeline.core.precision import PRECISIONS
from pipelaunch.pipeline.graph.tensor_parallel import resolve
from pipelaunch.pipeline.graph.trace import TracedModel
from pipelaunch.pipeline.planner.build import PlanRequest, build_plan, needs_profile
from pipelaunch.pipeline.planner.fit.under_cap import fit_budget
from pipelaunch.pipeline.planner.measure.optimizer_costs import (
    optimizer_seconds_per_byte,
    optimizer_temporaries,
)
from pipelaunch.pipeline.planner.measure.overheads import cached_overheads
from pipelaunch.pipeline.planner.measure.traced import TracedModels, micro_batch_size
from pipelaunch.pipeline.planner.passes.p2p_check import check_plan
from pipelaunch.pipeline.planner.predict.prediction import Prediction, predict
from pipelaunch.pipeline.planner.schedules.base import ScheduleGenerator
from pipelaunch.pipeline.planner.search.choose import Candidate, Outcome, SearchResult
from pipelaunch.pipeline.planner.search.layouts import cp_degrees
from pipelaunch.pipeline.planner.search.screen import ModelCosts, Screen
from pipelaunch.pipeline.planner.search.space import build_generator, search, search_space


@dataclass(frozen=True)
class Planned:
    """The finished Plan, and the planner's working objects a dry run draws (the simulated step,
    each device's memory) and a search printed."""

    plan: Plan
    prediction: Prediction | None = None
    search: SearchResult | None = None
    #: the model as the launcher built it on the meta device (checks against a checkpoint read it)
    model: torch.nn.Module | None = None
    #: the traces planning made, by (micro-batch size, tp, the modules tp splits): the model at
    #: those shapes (one tp rank's under tp > 1), or None where none was made (`TracedModels.made`)
    traces: Callable[[int, int, Mapping[str, str]], TracedModel | None] | None = None


def make_plan(cfg: TrainConfig, spec: ModelSpec, plugins: Plugins, options: GroupOptions, *,
              profile: bool | None = None, device: torch.device | None = None, cuda: bool = False) -> Planned:
    """The Plan of this run, from the plug-ins the launcher built (`plugins`) and, for a search,
    the group options it compares. Profiled (on `device`, or for a GPU run in the launcher a child
    on cuda:0 when `cuda`) whenever something reads costs; `profile=False` only validates that the
    config can be planned (joined ranks before rank 0 plans for all). With a hardware file
    (`hardware=<name>`) every cost is priced on its figures instead, for its device and links."""
    hw = configured_hardware(cfg.hardware)
    if hw is None:
        return _make_plan(cfg, spec, plugins, options, profile, device, cuda, None)
    try:  # priced for that device: its memory is the budget, its links the links
        return _make_plan(for_hardware(cfg, hw), spec, plugins, options, profile, device, True, hw)
    except ConfigError as err:
        if err.key not in ("memory.cap_bytes", "plan"):
            raise
        raise ConfigError(err.key, f"{str(err).split(': ', 1)[1]} (the cap is one {hw.device_name}'s memory, "
                                   f"hardware={hw.name}: {hw.memory_bytes / 1e9:.0f} GB, of which "
                                   f"{max(cfg.memory.reserve_bytes, hw.reserve_bytes) / 1e9:.1f} GB is set aside "
                                   "for what a rank holds beyond the model)") from None


def _make_plan(cfg: TrainConfig, spec: ModelSpec, plugins: Plugins, options: GroupOptions, profile: bool | None,
               device: torch.device | None, cuda: bool, hw: Hardware | None) -> Planned:
    searching = cfg.plan.search or plugins.search_schedules
    generator = None if plugins.scheduler is None else build_generator(plugins.scheduler)
    if profile is None:
        profile = needs_profiling(cfg, plugins, generator)
    models = TracedModels(spec, plugins.model, cfg, profile, cuda=cuda, device=device, hardware=hw)
    # (under plan.devices the configured dp may not split the batch: a layout's candidates trace
    # their own micro-batch size, this one only gives the graph's shape)
    size = max(1, micro_batch_size(cfg, cfg.microbatches))
    facts = _machine_facts(cfg, plugins, cuda, profile) if hw is None else hardware_facts(plugins, hw)
    tps = tp_degrees(cfg, spec, hw)
    tp_modules = tensor_parallel_modules(max(tps), spec, models)
    models.tp_modules = tp_modules
    models.tp_link, models.ep_link = _group_links(cfg, cuda, profile, facts, max(tps), hw)
    models.cp_link = _cp_link(cfg, facts, hw, cfg.cp, cfg.tp)
    cps = context_degrees(cfg, spec)

    experts = partial(_trace_layout, cfg, facts, hw, models.ep_link)

    def links(c: Candidate | None) -> tuple[tuple[float, float], tuple[float, float] | None]:
        """The (latency, bandwidth) of the pipeline's link and, on a hardware file, the replicas'
        (the group the gradients are reduced over: dp x cp, `grad_link`)."""
        if hw is None:
            return (facts["link_latency_s"], cfg.link_bandwidth), None
        pp, dp, tp = (cfg.pp, cfg.dp, cfg.tp) if c is None or c.pp is None else (c.pp, c.dp, c.tp or 1)
        pp_link, dp_link = grad_link(hw, pp, dp, tp, cfg.cp if c is None or c.cp is None else c.cp)
        return (pp_link.latency_s, pp_link.bandwidth), (dp_link.latency_s, dp_link.bandwidth)

    def link(c: Candidate | None = None) -> tuple[float, float]:
        return links(c)[0]

    def build(gen: ScheduleGenerator, traced: TracedModel, c: Candidate | None = None,
              whole: list[int] | None = None) -> Plan:
        tp = c.tp if c is not None and c.tp is not None else cfg.tp
        own = models.at_cp(None if c is None else c.cp).spec  # the model at the candidate's cp
        req = _request(cfg, own, plugins, traced, c, facts, profile, cuda)
        slots = None if req.rank_slots is None else req.rank_slots / tp  # a simulated rank is tp processes
        (latency, bandwidth), dp_link = links(c)
        req = replace(req, tp=tp, tp_modules=tp_modules if tp > 1 else {}, rank_slots=slots,
                      sequence_parallel=cfg.sequence_parallel and tp > 1, link_latency_s=latency, bandwidth=bandwidth,
                      dp_link=dp_link, cost_source=hw.source if hw is not None else _measured_source(cuda, profile))
        return build_plan(traced, gen, req if whole is None else replace(req, whole_stages=tuple(whole)))

    if searching and not profile:
        return Planned(_first_plannable(cfg, plugins, options, models, build, models.get(size)), model=models.model,
                       traces=models.made)
    if searching:
        cands, given = search_space(cfg, plugins, options, models.structure(size).graph, tps,
                                    int(spec.meta.get("experts") or 0) if cfg.plan.devices is not None else 0, cps)
        screen = Screen(costs=lambda tp, mbs, ep=None: _model_costs(models.get(mbs, tp, **dict(ep or ())), mbs),
                        graph=lambda tp, mbs, ep=None: models.get(mbs, tp, **dict(ep or ())).graph,
                        experts=lambda c: tuple(sorted(experts(c).items())) or None,
                        micro_batch_size=lambda c: micro_batch_size(cfg, c.microbatches, c.dp), links=links,
                        optimizer_s_per_byte=facts["optimizer_s_per_byte"],
                        optimizer_states=plugins.optimizer.states_per_param, configured_zero=cfg.zero,
                        reserve_bytes=cfg.memory.reserve_bytes, cap=cfg.memory.cap_bytes,
                        by_default=hw is not None, layout=(cfg.pp, cfg.dp, cfg.tp), cp=cfg.cp,
                        optimizer_temporaries=tuple(facts["optimizer_temporaries"]))
        result = search(cfg, models, build, cands, given, link, screen, experts)
        if hw is not None:
            result.per_device = _per_device(cfg, spec, models, hw, experts)
        if any(c.ep is not None for c in cands):
            result.experts_of = lambda o: expert_facts(o.prediction)
        prediction = result.winner.prediction
        chosen = models.at_cp(result.winner.candidate.cp)  # the models of the winner's cp (a search over cp)
        return Planned(_finished(prediction.plan, prediction, result), prediction, result,
                       chosen.model or models.model, chosen.made)
    traced = models.get(size)
    plan = build(generator, traced)
    if not profile:
        return Planned(_finished(plan, None, None), model=models.model, traces=models.made)
    prediction = fit_budget(plan, predict(plan, *link(), collectives=False), traced.graph, cfg.memory.cap_bytes, *link(),
                            rebuild=lambda whole: build(generator, traced, whole=whole))
    return Planned(_finished(prediction.plan, prediction, None), prediction, model=models.model, traces=models.made)


def _trace_layout(cfg: TrainConfig, facts: dict, hw: Hardware | None, ep_link: tuple[float, float],
                  c: Candidate | None) -> dict:
    """What a candidate's trace is priced at beyond its tp (`TracedModels.get`'s keywords): the
    expert-parallel degree it holds one rank's experts of and the link its all-to-alls cross
    (`Hardware.ep_link`: its ranks are pp x cp x tp devices apart; this machine's `ep_link`
    without a hardware file); under a search over cp its context-parallel degree and the cp
    group's link."""
    out: dict = {}
    if c is not None and c.cp is not None:
        out.update(cp=c.cp, cp_link=_cp_link(cfg, facts, hw, c.cp, c.tp or 1))
    if c is None or c.ep is None:
        return out
    if hw is None:
        return {**out, "ep": c.ep, "ep_link": ep_link}
    link = hw.ep_link(c.pp, (c.tp or 1) * (c.cp or cfg.cp), c.ep)
    return {**out, "ep": c.ep, "ep_link": (link.latency_s, link.bandwidth)}


#: the devices tensor parallelism may span by default: one node's (8 GPUs, NVLink); a hardware
#: file gives its own (`devices_per_node`)
NODE_DEVICES = 8


def _group_links(cfg: TrainConfig, cuda: bool, profile: bool, facts: dict, tp: int,
                 hw: Hardware | None) -> tuple[tuple[float, float], tuple[float, float]]:
    """The (latency, bandwidth) the tp group's collectives and the ep group's all-to-alls are
    priced on: a hardware file's links (ep: `Hardware.ep_link`), else this machine's."""
    if hw is None:
        return tp_link(cfg, cuda, profile, facts["link_latency_s"], tp), (facts["link_latency_s"], cfg.link_bandwidth)
    ep = hw.ep_link(cfg.pp, cfg.tp, cfg.ep)
    return (hw.intra_node.latency_s, hw.intra_node.bandwidth), (ep.latency_s, ep.bandwidth)


def _cp_link(cfg: TrainConfig, facts: dict, hw: Hardware | None, cp: int, tp: int) -> tuple[float, float]:
    """The (latency, bandwidth) the cp group's exchanges are priced on: inside a node while its cp x
    tp ranks fit one (they are consecutive ranks), else across; this machine's link without a
    hardware file."""
    if hw is None:
        return facts["link_latency_s"], cfg.link_bandwidth
    link = hw.intra_node if cp * tp <= hw.devices_per_node else hw.inter_node
    return link.latency_s, link.bandwidth


def grad_link(hw: Hardware, pp: int, dp: int, tp: int, cp: int):  # noqa: ANN201 - (Link, Link)
    """(pipeline link, the link the gradients are reduced on) of a layout: the ranks are numbered
    tp fastest, then cp, then pp, then dp (pipeline/core/layout.py), so a pipeline spans pp x cp x tp
    devices and the reduction's group, dp x cp, strides over the pipelines (`Hardware.links` with
    cp x tp devices a pipeline rank), or at dp=1 is the cp group alone, cp x tp consecutive devices."""
    pp_link, dp_link = hw.links(pp, dp, tp * cp)
    if dp == 1 and cp > 1:
        dp_link = hw.intra_node if cp * tp <= hw.devices_per_node else hw.inter_node
    return pp_link, dp_link


def context_degrees(cfg: TrainConfig, spec: ModelSpec) -> list[int] | None:
    """The context-parallel degrees a `plan.devices` search tries (`search/layouts.py` `cp_degrees`),
    None without one or where cp is no axis of it (plan.cp null on a model or config cp does not
    run beside, or in a search that trains: the configured cp); a `plan.cp` such a model cannot run
    is refused naming why. Under cp_method=alltoall only degrees dividing the heads."""
    if cfg.plan.devices is None:
        return None
    meta, packing = spec.meta, str(cfg.data.get("packing") or "none") if hasattr(cfg.data, "get") else "none"
    refusal = None
    if "context_parallel" not in meta:
        refusal = f"model={spec.name} does not run attention over a cp group (model=gpt, model=hf and model=module do)"
    elif meta.get("experts") and (cfg.moe.capacity_factor is not None or (spec.own_loss and meta.get("router_aux_loss"))):
        refusal = "its experts' capacity, or the auxiliary loss inside its own loss, counts one cp rank's tokens"
    elif meta.get("dropout"):
        refusal = f"model.dropout={meta['dropout']} does not run beside cp yet"
    elif packing not in ("none", "documents") or (hasattr(cfg.data, "get") and cfg.data.get("buckets")):
        refusal = "the data's packing or buckets do not run beside cp yet"
    seq = meta.get("seq_len")
    found = cp_degrees(cfg, int(seq) if seq else None, refusal)
    if cfg.plan.cp is None and (refusal is not None or cfg.mode != "plan"):
        return None  # cp is no axis of this search: the configured one, nothing said of it
    heads = int(meta.get("heads") or 0)
    if cfg.cp_method == "alltoall" and heads:
        found = [c for c in found if heads % c == 0]
    return found


def for_hardware(cfg: TrainConfig, hw: Hardware) -> TrainConfig:
    """The config as planned for `hw`: its memory is each device's budget (or the configured cap,
    if lower) and what a device holds beyond the model (its `reserve_bytes`) is set aside."""
    cap = hw.memory_bytes if cfg.memory.cap_bytes is None else min(cfg.memory.cap_bytes, hw.memory_bytes)
    memory = replace(cfg.memory, cap_bytes=cap, reserve_bytes=max(cfg.memory.reserve_bytes, hw.reserve_bytes))
    return replace(cfg, memory=memory)


def _model_costs(traced: TracedModel, size: int) -> ModelCosts:
    """The screen's sums over one priced graph, with the largest parameter tensor the update's
    temporaries scale with."""
    largest = max((float(p.numel() * p.element_size()) for p in traced.gm.parameters()), default=0.0)
    return ModelCosts.of(traced.graph, size, largest)


def hardware_facts(plugins: Plugins, hw: Hardware) -> dict:
    """What the prediction reads of a device it cannot measure: its own GPU per rank, the
    optimizer step as a memory-bound pass (each parameter byte read, its gradient read, each
    state read and written, the parameter written: 3 + 2 x states bytes moved per byte), the
    GPU's temporaries, the network's latency, no fixed cost per action beyond the kernels'
    launches (priced per node)."""
    states = plugins.optimizer.states_per_param
    return {"rank_slots": None, "optimizer_s_per_byte": (3 + 2 * states) / hw.bytes_per_s(),
            "optimizer_temporaries": optimizer_temporaries(plugins.optimizer, True),
            "link_latency_s": hw.inter_node.latency_s, "action_overhead_s": 0.0}


def _per_device(cfg: TrainConfig, spec: ModelSpec, models: TracedModels, hw: Hardware,
                experts: Callable[[Candidate | None], dict] = lambda c: {}) -> Callable[[Outcome], tuple[float, float]]:
    """An outcome's tokens per second per device and its model FLOPs utilisation: the model's
    FLOPs per step (forward and backward as priced, recomputation not counted) over the step and
    every device's peak, in the dtype the run computes in. A mixture of experts counts 6 FLOPs per
    activated parameter and token instead (`activated_params`: a token's top_k routed experts, not
    all of them), as MoE papers state their MFU."""
    dtype = "bf16" if str(cfg.precision) == "bf16" else "fp32"
    peak = hw.peak_flops.get(dtype, hw.peak_flops["fp32"])
    activated = activated_params(spec) if spec.meta.get("experts") else None

    def figures(o: Outcome) -> tuple[float, float]:
        c, p = o.candidate, o.prediction
        pp, dp, tp = (c.pp, c.dp, c.tp or 1) if c.pp is not None else (cfg.pp, cfg.dp, cfg.tp)
        cp = cfg.cp if c.cp is None else c.cp
        devices = pp * dp * tp * cp
        tokens = cfg.batch_size * spec.tokens_per_sample / p.step_s / devices
        if activated is not None:
            return tokens, 6.0 * activated * tokens / peak
        graph = models.get(micro_batch_size(cfg, c.microbatches, dp), tp, **experts(c)).graph
        # one rank's FLOPs (its attention over every cp rank's keys: measure/context.py), the whole job's
        flops = float(graph.graph.get("model_flops", 0.0)) * tp * cp * c.microbatches * dp
        return tokens, flops / (p.step_s * devices * peak)

    return figures


def expert_facts(prediction: Prediction) -> tuple[float, float]:
    """A prediction's (routed experts' parameter bytes on its fullest device, seconds its busiest
    pipeline rank spends in all-to-alls per step: its stages' `stage_exchange_s`, once per
    micro-batch); (0, 0) without ep."""
    plan = prediction.plan
    placement = plan.schedule.placement
    held, exchange = [0.0] * (max(placement) + 1), [0.0] * (max(placement) + 1)
    for stage, rank in enumerate(placement):
        held[rank] += float((plan.meta.stage_expert_param_bytes or [0.0] * len(placement))[stage])
        exchange[rank] += float((plan.meta.stage_exchange_s or [0.0] * len(placement))[stage]) * plan.microbatches
    return max(held), max(exchange)


def activated_params(spec: ModelSpec) -> float:
    """The parameters one token computes with: every matmul weight, of the routed experts only a
    token's top_k of them (the input embedding, a lookup, is not counted; the output head is)."""
    model = spec.build_meta()
    total = sum(p.numel() for n, p in model.named_parameters() if p.dim() > 1 and not _is_embedding(model, n))
    routed = 0.0
    for module in model.modules():
        # a routed-experts module (models/moe.py `Experts`, or one like it): `total` experts in
        # its expert parameters, of which a token computes top_k
        if isinstance(getattr(module, "total", None), int) and hasattr(module, "expert_parameters"):
            top_k = getattr(module, "top_k", None) or spec.meta["top_k"]
            share = 1.0 - top_k / module.total
            routed += share * sum(p.numel() for _, p in module.expert_parameters())
    return total - routed


def _is_embedding(model: torch.nn.Module, name: str) -> bool:
    module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return isinstance(module, torch.nn.Embedding)


def _measured_source(cuda: bool, profile: bool) -> str | None:
    if not profile:
        return None
    return "hardware=local: measured on this machine's GPU" if cuda else "hardware=local: measured on this machine's CPU"


def tp_degrees(cfg: TrainConfig, spec: ModelSpec, hw: Hardware | None = None) -> list[int]:
    """The tensor-parallel degrees planned: the configured tp, or under `plan.devices` those of
    `plan.tp` (null: every divisor of the devices up to a node's (`hw.devices_per_node`, else
    NODE_DEVICES) the model can be split over, `ModelSpec.tp_refusal`; tp=1 alone for a model with
    routed experts, which ep splits instead: the tp rewrite cannot trace a MoE layer's routing)."""
    node = NODE_DEVICES if hw is None else hw.devices_per_node
    devices = cfg.plan.devices
    if devices is None:
        return [cfg.tp]
    if cfg.plan.tp is not None:
        wanted = list(cfg.plan.tp)
        bad = [t for t in wanted if isinstance(t, bool) or not isinstance(t, int) or t < 1 or devices % t]
        if bad or not wanted:
            raise ConfigError("plan.tp", f"got {wanted!r}; valid: a list of tensor-parallel degrees dividing "
                                         f"plan.devices={devices}, e.g. [1, 2, 4], or null")
        refused = [f"{t}: {spec.tp_refusal(t)}" for t in wanted if spec.tp_refusal(t)]
        if refused:
            raise ConfigError("plan.tp", f"the model cannot be split as asked ({'; '.join(refused)})")
        across = [t for t in wanted if t > node]
        if across:
            raise ConfigError("plan.tp", f"tp={across[0]} spans more devices than a node of {hw.name if hw else 'GPUs'} "
                                         f"has ({node}): a tensor-parallel group stays inside a node (its collectives "
                                         f"run at every layer); list degrees up to {node}")
        return sorted(set(wanted))
    if spec.meta.get("experts"):  # a MoE layer's routing is value-dependent: the tp rewrite cannot trace it
        return [1]
    return [t for t in range(1, min(devices, node) + 1) if devices % t == 0 and spec.tp_refusal(t) is None]


def tensor_parallel_modules(tp: int, spec: ModelSpec, models: TracedModels) -> dict[str, str]:
    """Under tp > 1, the model's tensor-parallel plan (`ModelSpec.tp_plan`) resolved against its
    modules: module name -> style; a model without one is refused naming `model.tp_plan`."""
    if tp == 1:
        return {}
    if not spec.tp_plan:
        raise ConfigError("model.tp_plan", f"tp={tp} splits every stage over {tp} ranks, but model={spec.name} has no "
                                           "tensor-parallel plan; give one (model.tp_plan: {module pattern: colwise | "
                                           "rowwise | vocab | replicate | sequence}, docs/tensor_parallel.md), or tp=1")
    if models.model is None:
        models.model = spec.build_meta()
    resolved = resolve(models.model, spec.tp_plan)
    named = [n for n, style in resolved.items() if style == "sequence"]
    if named and not models.cfg.sequence_parallel:
        raise ConfigError("model.tp_plan", f"the plan runs {', '.join(named[:3])} on each tp rank's positions "
                                           "(sequence), which needs sequence_parallel=true; set it, or plan them "
                                           "as replicate")
    return resolved


def needs_profiling(cfg: TrainConfig, plugins: Plugins, generator: ScheduleGenerator | None) -> bool:
    """Whether anything reads measured costs: a search, a dry run, `predict`, a partitioner or a
    schedule that reads them, or a memory budget."""
    return bool(cfg.plan.search or plugins.search_schedules or cfg.mode == "plan" or cfg.predict
                or needs_profile(plugins.partitioner) or getattr(generator, "cost_aware", False)
                or cfg.memory.cap_bytes is not None)


def _machine_facts(cfg: TrainConfig, plugins: Plugins, cuda: bool, profile: bool) -> dict:
    """What the prediction reads of this machine: how many ranks' worth of cores it has when the
    local ranks need more (CPU), the optimizer's time and temporaries per parameter byte, and the runtime's
    latency per message and fixed cost per compute action (`overheads`)."""
    threads = cpu_threads(cfg.threads, cfg.world_size)
    latency, action = runtime_overheads(cfg, cuda, profile, threads)
    return {"rank_slots": rank_slots(cfg, cuda),
            "optimizer_s_per_byte": optimizer_seconds_per_byte(plugins.optimizer, threads) if profile else 0.0,
            "optimizer_temporaries": optimizer_temporaries(plugins.optimizer, cuda) if profile else (0.0, 0.0),
            "link_latency_s": latency, "action_overhead_s": action}


def runtime_overheads(cfg: TrainConfig, cuda: bool, profile: bool, threads: int) -> tuple[float, float]:
    """(seconds per message, seconds per compute action) the predictions price: as configured, or,
    left null, measured once on this machine when a CPU run with several ranks reads costs;
    otherwise the default latency and no action cost."""
    latency, action = cfg.link_latency_s, cfg.action_overhead_s
    if (latency is None or action is None) and profile and not cuda and cfg.world_size > 1:
        measured = cached_overheads(threads)
        if measured is not None:
            latency = measured.latency_s if latency is None else latency
            action = measured.action_s if action is None else action
    return (cfg.link[0] if latency is None else latency), (0.0 if action is None else action)


def tp_link(cfg: TrainConfig, cuda: bool, profile: bool, link_latency_s: float, tp: int) -> tuple[float, float]:
    """(seconds per ring step, bytes per second) of the link tp's all-reduces are priced on: as
    configured, else on a CPU run what the probe measured of two busy ranks' all-reduces (of one
    value and of a MiB), else the pipeline link's."""
    latency, bandwidth = cfg.tp_link_latency_s, cfg.tp_link_bandwidth
    if (latency is None or bandwidth is None) and profile and not cuda and tp > 1:
        measured = cached_overheads(cpu_threads(cfg.threads, cfg.world_size))
        link = measured.all_reduce_link() if measured is not None else None
        if link is not None:
            latency = link[0] if latency is None else latency
            bandwidth = link[1] if bandwidth is None else bandwidth
    return (link_latency_s if latency is None else latency, cfg.link_bandwidth if bandwidth is None else bandwidth)


def rank_slots(cfg: TrainConfig, cuda: bool) -> float | None:
    """On CPU, how many ranks' worth of cores this machine has when its local ranks need more
    (pp x dp ranks of `threads` threads on fewer cores take turns); None when each has its own.
    The simulator plays one rank per (pipeline rank, replica): under tp each stands for tp
    processes, so a plan divides these slots by its tp."""
    if cuda:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.world_size)
    threads = cpu_threads(cfg.threads, local)
    cores = available_cores()
    return cores / threads if local * threads > cores else None


def _request(cfg: TrainConfig, spec: ModelSpec, plugins: Plugins, traced: TracedModel, c: Candidate | None,
             facts: dict, profile: bool, cuda: bool) -> PlanRequest:
    microbatches = c.microbatches if c else cfg.microbatches
    pp, dp = (cfg.pp, cfg.dp) if c is None or c.pp is None else (c.pp, c.dp)  # plan.devices: the candidate's
    return PlanRequest(
        model_name=spec.name, pp=pp, dp=dp, microbatches=microbatches, batch_size=cfg.batch_size,
        placement=plugins.placement, partitioner=c.partitioner_plugin if c else plugins.partitioner,
        remat=c.remat if c else str(cfg.remat), memory_cap=cfg.memory.cap_bytes,
        reserve_bytes=cfg.memory.reserve_bytes, optimizer_states=plugins.optimizer.states_per_param,
        bandwidth=cfg.link_bandwidth, profiled=profile, precision=str(cfg.precision),
        zero=cfg.zero if c is None or c.zero is None else c.zero, dp_shard=cfg.dp_shard,
        reshard=str(cfg.reshard if c is None or c.reshard is None else c.reshard), device_type="cuda" if cuda else "cpu",
        bucket_bytes=cfg.dp_bucket_bytes,
        evaluates=cfg.eval.every > 0, data_args=tuple(spec.data_args), ep=cfg.ep if c is None or c.ep is None else c.ep,
        moe_overlap=cfg.moe.overlap, cp=cfg.cp if c is None or c.cp is None else c.cp, cp_method=cfg.cp_method,
        value_dtypes=_autocast_dtypes(cfg, spec, traced, micro_batch_size(cfg, microbatches, dp), cuda),
        **facts)


def _autocast_dtypes(cfg: TrainConfig, spec: ModelSpec, traced: TracedModel, mbs: int,
                     cuda: bool) -> dict[str, torch.dtype] | None:
    """Under precision=bf16, the dtype autocast gives every value on the run's device type (what
    a sender produces, so what its receiver allocates); found on fake tensors, no GPU touched."""
    from pipelaunch.pipeline.planner.measure.autocast import cached_autocast_dtypes

    return cached_autocast_dtypes(traced, spec.meta_args(mbs), cuda, PRECISIONS[str(cfg.precision)], mbs)


def _first_plannable(cfg: TrainConfig, plugins: Plugins, options: GroupOptions, models: TracedModels, build,
                     traced: TracedModel) -> Plan:
    """Validation without a profile: any candidate that builds shows the config can be planned."""
    cands, _ = search_space(cfg, plugins, options, traced.graph)
    errors = []
    for c in cands:
        try:
            gen = build_generator(c.scheduler_plugin)
            return _finished(build(gen, models.get(micro_batch_size(cfg, c.microbatches, c.dp), c.tp, ep=c.ep,
                                                   cp=c.cp), c),
                             None, None)
        except ConfigError as err:
            errors.append(err)
    raise errors[0] if errors else ConfigError("scheduler", "scheduler=auto has no candidate schedules")


def _finished(plan: Plan, prediction: Prediction | None, result: SearchResult | None) -> Plan:
    """The plan with what the planner predicted and what its search chose recorded in it, its
    programs proven to keep NCCL's rules (a plan that breaks them never spawns; checked here, on
    the one plan that leaves the planner, not on every candidate and refit a search builds)."""
    check_plan(plan)
    found: dict = {}
    if prediction is not None:
        found["device_memory"] = list(prediction.devices)
        found["prediction"] = PlannedStep(prediction.step_s, prediction.schedule_s, prediction.result.makespan_s,
                                          prediction.result.bubble, prediction.result.peak_activation_bytes)
    if result is not None:
        win = result.winner.candidate
        found["search"] = SearchSummary(
            chosen={"label": win.label, **win.overrides(), "scheduler_option": win.scheduler}, **result.to_dict())
    return replace(plan, meta=replace(plan.meta, **found))
