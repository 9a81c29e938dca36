"""Closed-form estimates of every candidate of a large search, so that only the most promising
are planned and simulated in full.

Why: a search over `plan.devices=3072` holds thousands of candidates (layouts x schedules x
micro-batch counts x remat), and planning one at a 1T model's size (pp=64, 512 micro-batches:
100k actions to order, lower, check and simulate) takes seconds. Every candidate is instead
estimated from a few numbers per (tp degree, micro-batch size) of the priced model (forward, input
and weight gradient time per micro-batch, the bytes it saves: priced at the search's smallest and
largest micro-batch of each tp degree, the sizes between on the line through them) and two per schedule (its bubble and
the activations it holds, measured by running the schedule's own generator on a small pipeline):

    step ~ (m + bubble(p)) x rank work per micro-batch + pipeline fill hops
           + optimizer step + the replicas' gradient reduction not hidden under the last backward
    peak ~ weights, gradients, optimizer state (sharded by zero) + held(p, m) x activations per
           micro-batch of a rank + what the device sets aside

`bubble(p)` and `held(p, m)` come from the generator's order at p0 = min(p, 4) ranks and m0 micro-
batches in the same ratio to the ranks (m0 <= 4 p0), on a transformer's F:I:W (1:1:1): the idle slots of a
rank scale with p - 1 (the fill and drain), the micro-batches in flight with p (or with m, when the
schedule holds all of them, as GPipe does). A user's own schedule is estimated by the same
measurement; nothing here knows a schedule by name. A rank's work, parameters and activations are
the fullest rank's shares under the candidate's own split: its partitioner run once per placement
on the priced graph (an even split missed how uniform's leaves a large head on the last stage,
and how 128 layers on 96 stages leave some ranks three).

What it leaves out, and why that is safe: zero=3's gathers, kernel-level overlap, how the split
moves with the micro-batch size. The estimate only orders candidates; the best `plan.simulate` are
then planned and simulated as every candidate of a small search is, and only those predictions
are ranked and reported. `bench/RESULTS.md` records how far the estimates are from the simulated
steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

import networkx as nx

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Kind, Schedule
from pipelaunch.pipeline.graph.derived import sent_bytes
from pipelaunch.pipeline.planner.build import partition_graph
from pipelaunch.pipeline.planner.partition import Partition, PartitionRequest
from pipelaunch.pipeline.planner.passes.remat import recompute_options
from pipelaunch.pipeline.planner.placement import placement_for
from pipelaunch.pipeline.planner.predict.memory import UpdateMemory
from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate
from pipelaunch.pipeline.planner.schedules import build_schedule
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts, ScheduleGenerator
from pipelaunch.pipeline.planner.search.choose import Candidate

#: the most ranks and micro-batches per rank a schedule's shape is measured at
SMALL_PP, SMALL_RATIO = 4, 4
#: a candidate whose estimated peak is this much over the cap is left out unsimulated (the
#: estimate's own error: the fit may still find a split, or remat=auto a recomputation, under it)
MEMORY_SLACK = 0.15
#: ... and whose parameters, gradients, optimizer state and update alone are this much over it:
#: they are counted from the parameter bytes of the candidate's own split, as the prediction
#: counts them, so only a block the fit moves can change them
STATE_SLACK = 0.05
#: a schedule's rules are checked at the candidate's own size up to this many forwards (a check
#: may build the whole order: torch's does); past it, on the small pipeline the shape is
#: measured on, and at full size when the candidate is planned
CHECKED_ACTIONS = 256
#: the candidates that must fit among those simulated when `plan.simulate` is null and the
#: search holds more than SIMULATE_ALL of them; at most TRIES times as many are simulated
DEFAULT_SIMULATED, SIMULATE_ALL, TRIES = 3, 64, 3
#: a candidate about to be planned has its schedule's shape simulated at its own size (not scaled
#: from a small one) up to this many stage-micro-batches: a 1T GPT's interleaved order at pp=64
#: and 512 micro-batches (65,536) takes 0.5 s; V-Half's bubble at pp=24 is 4x its scaled one
EXACT_STAGE_MICROBATCHES = 70_000


@dataclass(frozen=True)
class ModelCosts:
    """What one micro-batch of the whole model costs at one (tp degree, micro-batch size), summed
    over the priced graph's nodes: seconds of forward, input-gradient, weight-gradient and fused
    backward, bytes saved for the backward, parameter bytes (one tp rank's), the largest node's
    parameters and compute, and the median bytes a node outputs (what a stage boundary carries)."""

    size: int
    forward: float
    input_grad: float
    weight_grad: float
    backward: float
    saved_bytes: float
    param_bytes: float
    largest_params: float
    largest_work: float
    boundary_bytes: float
    #: nodes of the traced graph: no split has more stages
    nodes: int = 1
    #: the largest parameter tensor's bytes (the optimizer step's temporaries scale with it)
    largest_tensor: float = 0.0
    #: per remat mode recomputing every block ("full", "selective"): what a micro-batch then holds,
    #: the seconds one rerun of every block takes, the largest block's rerun buffer
    recomputed: tuple[tuple[str, float, float, float], ...] = ()
    #: under ep > 1, of `param_bytes` one ep rank's routed experts (reduced, and sharded, over the
    #: dp / ep expert replicas only)
    expert_bytes: float = 0.0
    #: under ep > 1, the seconds of every MoE layer's all-to-alls in one micro-batch's forward and
    #: backward (in the times above; for the reasons a search gives)
    exchange_s: float = 0.0

    @classmethod
    def of(cls, graph: nx.DiGraph, size: int, largest_tensor: float = 0.0) -> ModelCosts:
        nodes = [graph.nodes[n] for n in graph.nodes]

        def total(key: str) -> float:
            return float(sum(d.get(key, 0.0) or 0.0 for d in nodes))

        outputs = sorted(float(sent_bytes(d)) for d in nodes if sent_bytes(d))
        saved = total("activation_bytes") + total("loss_activation_bytes")
        return cls(size, total("forward_s"), total("backward_input_s"), total("backward_weight_s"), total("backward_s"),
                   saved, total("param_bytes"),
                   max((float(d.get("param_bytes", 0) or 0) for d in nodes), default=0.0),
                   max((float(d.get("forward_s", 0) or 0) + float(d.get("backward_s", 0) or 0) for d in nodes),
                       default=0.0),
                   outputs[len(outputs) // 2] if outputs else 0.0, graph.number_of_nodes(), largest_tensor,
                   _recomputed(graph, saved), *_experts(graph))

    def recompute(self, remat: str) -> tuple[float, float, float]:
        """(bytes a micro-batch holds, seconds of one rerun, rerun buffer) with every block
        recomputed `remat`; (saved bytes, 0, 0) for a mode recomputing no block."""
        for mode, held, rerun, buffer in self.recomputed:
            if mode == remat:
                return held, rerun, buffer
        return self.saved_bytes, 0.0, 0.0

    def at(self, size: int, other: ModelCosts | None = None) -> ModelCosts:
        """The model at another micro-batch size: along the line through this size's costs and
        `other`'s (a kernel's time is affine in the samples: its FLOPs and activation bytes grow
        with them, its weight reads and launch do not), or, without `other`, in proportion."""
        if other is None or other.size == self.size:
            k = size / self.size
            return ModelCosts(size, self.forward * k, self.input_grad * k, self.weight_grad * k, self.backward * k,
                              self.saved_bytes * k, self.param_bytes, self.largest_params, self.largest_work * k,
                              self.boundary_bytes * k, self.nodes, self.largest_tensor,
                              tuple((mode, *(x * k for x in rest)) for mode, *rest in self.recomputed),
                              self.expert_bytes, self.exchange_s * k)
        t = (size - self.size) / (other.size - self.size)

        def line(a: float, b: float) -> float:
            return max(0.0, a + (b - a) * t)

        others = {mode: rest for mode, *rest in other.recomputed}
        recomputed = tuple((mode, *(line(a, b) for a, b in zip(rest, others.get(mode, rest), strict=True)))
                           for mode, *rest in self.recomputed)
        return ModelCosts(size, line(self.forward, other.forward), line(self.input_grad, other.input_grad),
                          line(self.weight_grad, other.weight_grad), line(self.backward, other.backward),
                          line(self.saved_bytes, other.saved_bytes), self.param_bytes, self.largest_params,
                          line(self.largest_work, other.largest_work), line(self.boundary_bytes, other.boundary_bytes),
                          self.nodes, self.largest_tensor, recomputed, self.expert_bytes,
                          line(self.exchange_s, other.exchange_s))


@dataclass(frozen=True)
class Estimate:
    """A candidate's estimated step and fullest device, or why it cannot run (`error`)."""

    step_s: float = math.inf
    peak_bytes: float = 0.0
    error: str | None = None
    #: of the peak, the activations the fullest device holds (the least certain part)
    activation_bytes: float = 0.0
    #: the update's temporaries on that device, held in place of the activations after the backward
    update_bytes: float = 0.0
    #: of the peak, the parameters, gradients, optimizer state and reserve (neither phase)
    state_bytes: float = 0.0

    def fits(self, cap: float | None, activation_scale: float = 1.0) -> bool:
        """Within the cap (and the estimate's slack), its activations scaled by `activation_scale`
        (what the simulated candidates held over what their estimates said)."""
        phase = max(self.activation_bytes, self.update_bytes)
        peak = self.peak_bytes - phase + max(self.activation_bytes * activation_scale, self.update_bytes)
        return self.error is None and (cap is None or (peak <= cap * (1 + MEMORY_SLACK) and
                                                       self.state_bytes + self.update_bytes <= cap * (1 + STATE_SLACK)))


@dataclass(frozen=True)
class Split:
    """The fullest rank's shares of the model under one split (each the largest over the ranks):
    of its compute, its parameters and its activations."""

    work: float
    params: float
    activations: float

    @classmethod
    def of(cls, part: Partition, placement: tuple[int, ...]) -> Split | None:
        def share(per_stage: list) -> float:
            ranks: dict[int, float] = {}
            for s, value in enumerate(per_stage):
                ranks[placement[s]] = ranks.get(placement[s], 0.0) + float(value)
            total = sum(ranks.values())
            return max(ranks.values()) / total if total > 0 else 1.0 / len(ranks)

        if not part.stage_compute_s or sum(part.stage_compute_s) <= 0:
            return None
        return cls(share(part.stage_compute_s), share(part.stage_param_bytes), share(part.stage_activation_bytes))


def _experts(graph: nx.DiGraph) -> tuple[float, float]:
    """(`ModelCosts.expert_bytes`, `ModelCosts.exchange_s`) of a priced graph: the parameter bytes
    of one ep rank's routed experts, and its MoE layers' all-to-alls in one micro-batch's forward
    and backward on the link they were priced on (measure/experts.py; 0, 0 without ep)."""
    from pipelaunch.pipeline.planner.measure.experts import exchange_s

    ep = int(graph.graph.get("ep", 1) or 1)
    if ep < 2:
        return 0.0, 0.0
    sizes = graph.graph.get("param_sizes", {})
    expert_bytes = float(sum(sizes.get(n, 0) for n in graph.graph.get("expert_params", ())))
    link = graph.graph.get("ep_link")
    exchange = 0.0 if link is None else sum(exchange_s(graph.nodes[n], ep, link) for n in graph.nodes)
    return expert_bytes, exchange


def _recomputed(graph: nx.DiGraph, saved: float) -> tuple[tuple[str, float, float, float], ...]:
    """`ModelCosts.recomputed` from the priced graph's blocks (remat.py's options, the model taken
    as one stage)."""
    options = recompute_options(graph, dict.fromkeys(graph.nodes, 0), False, keep_all=True)
    out = []
    for selective in (False, True):
        mine = [o for o in options if o.selective == selective]
        if mine:
            out.append(("selective" if selective else "full", saved - sum(max(0.0, o.saves_bytes) for o in mine),
                        sum(o.rerun_s or 0.0 for o in mine), max(o.rerun_bytes for o in mine)))
    return tuple(out)


@dataclass(frozen=True)
class Shape:
    """A schedule's order at a small scale: idle rank-micro-batch slots in its step (the bubble,
    in units of one rank's work per micro-batch) and the most stage-micro-batches a rank holds."""

    bubble: float
    held: float
    holds_all: bool


@lru_cache(maxsize=4096)
def schedule_shape(gen: ScheduleGenerator, pp: int, microbatches: int, remat: str,
                   fiw: tuple[float, float, float]) -> Shape:
    """The generator's own order at `pp` ranks and `microbatches`, on uniform stages whose F:I:W
    (a whole stage's) is `fiw`, simulated without hops (ConfigError where its rules refuse it)."""
    placement = placement_for(gen, pp)
    n = len(placement)
    f, i, w = (x * pp / n for x in fiw)
    costs = ScheduleCosts.of([f] * n, [i] * n, [w] * n)
    schedule = build_schedule(gen, placement, microbatches, "stage" if remat == "stage" else "none", costs=costs)
    result = simulate(schedule, CostModel([f] * n, [i] * n, [w] * n), check=False, memory=False)
    work = max(result.busy_s) / microbatches  # a rank's work per micro-batch (recomputation included)
    held = held_stage_microbatches(schedule)
    return Shape(max(0.0, result.makespan_s / work - microbatches), held, held >= microbatches - 1e-9)


def held_stage_microbatches(schedule: Schedule) -> float:
    """The most stage-micro-batches (a stage of v per rank counting 1/v) a rank holds, in program
    order: from its forward until its last backward action (W, or a fused B)."""
    share = schedule.pp / schedule.num_stages
    peak = 0.0
    for acts in schedule.actions:
        held = 0.0
        for a in acts:
            if a.kind is Kind.F:
                held += share
                peak = max(peak, held)
            elif a.kind in (Kind.B, Kind.W):
                held -= share
    return peak


def scaled_shape(gen: ScheduleGenerator, pp: int, microbatches: int, remat: str,
                 fiw: tuple[float, float, float]) -> Shape:
    """`schedule_shape` at `pp` and `microbatches`, measured at p0 = min(pp, SMALL_PP) ranks and
    micro-batches in the same ratio (at most SMALL_RATIO per rank) and scaled: the bubble with
    p - 1, what a rank holds with p (or with m, for a schedule holding every micro-batch)."""
    p0 = min(pp, SMALL_PP)
    if microbatches % pp == 0:
        m0 = p0 * min(microbatches // pp, SMALL_RATIO)
    else:
        m0 = max(1, min(round(microbatches * p0 / pp), SMALL_RATIO * p0))
    small = schedule_shape(gen, p0, m0, remat, fiw)
    if p0 == pp and m0 == microbatches:
        return small
    bubble = small.bubble * (pp - 1) / (p0 - 1) if p0 > 1 else 0.0
    held = small.held * microbatches / m0 if small.holds_all else min(small.held * pp / p0, float(microbatches))
    return Shape(bubble, held, small.holds_all)


@dataclass
class Screen:
    """Estimates candidates of one search (`estimate`) from the model's costs at each tp degree,
    priced once at one micro-batch size (`costs(tp)`: the traced graph of that tp, profiled), and
    the machine facts the full prediction reads."""

    #: the model's costs at (tp degree, micro-batch size, expert key): the traced graph of that tp,
    #: profiled (the key: what `experts` gives a candidate, None without ep)
    costs: Callable[..., ModelCosts]
    micro_batch_size: Callable[[Candidate], int]
    links: Callable[[Candidate], tuple[tuple[float, float], tuple[float, float] | None]]
    optimizer_s_per_byte: float
    optimizer_states: int
    configured_zero: int
    reserve_bytes: float
    #: a candidate's schedule generator (the search's own, built once per option)
    generator: Callable[[Candidate], ScheduleGenerator] | None = None
    #: each device's memory (None: no budget)
    cap: float | None = None
    #: whether a search screens without `plan.simulate` set (with a hardware file: a cluster's
    #: space; on this machine every candidate is planned, as measured costs are cheap to plan)
    by_default: bool = False
    #: (pp, dp, tp) of a candidate that does not set its layout (the configured ones)
    layout: tuple[int, int, int] = (1, 1, 1)
    #: the configured cp (a candidate of a search over cp carries its own)
    cp: int = 1
    #: the optimizer step's temporaries per byte (of the largest tensor, of all the rank's
    #: parameters: `optimizer_costs.optimizer_temporaries`)
    optimizer_temporaries: tuple[float, float] = (0.0, 0.0)
    #: per tp degree, the micro-batch sizes its costs are priced at (the search's smallest and
    #: largest; those between lie on the line through them)
    reference: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: the priced graph at (tp degree, micro-batch size, expert key), on which each candidate's
    #: split is run (None: every split taken as even)
    graph: Callable[..., nx.DiGraph] | None = None
    #: a candidate's expert key: what its trace is priced at under ep (hashable: its degree and the
    #: link its all-to-alls cross; None without ep)
    experts: Callable[[Candidate], tuple | None] = lambda c: None
    _priced: dict[tuple, ModelCosts] = field(default_factory=dict)
    _at: dict[tuple, ModelCosts] = field(default_factory=dict)
    _splits: dict[tuple, Split | None] = field(default_factory=dict)

    def _layout(self, c: Candidate) -> tuple[int, int, int]:
        return (c.pp, c.dp, c.tp or 1) if c.pp is not None else self.layout

    def _replicas(self, c: Candidate) -> int:
        """The ranks the gradients are reduced (and under zero sharded) over: dp x cp."""
        return self._layout(c)[1] * (self.cp if c.cp is None else c.cp)

    def _ep(self, c: Candidate) -> int:
        """The candidate's expert-parallel degree (1 without ep)."""
        return int(dict(self.experts(c) or ()).get("ep") or 1)

    def model_costs(self, tp: int, size: int, key: tuple | None = None) -> ModelCosts:
        """The model's costs at (tp, size) and expert key, from those priced at the reference
        sizes of tp (once per (tp, size, key): thousands of candidates share a few)."""
        lo, hi = self.reference.get(tp, (size, size))
        if (tp, size, lo, hi, key) in self._at:
            return self._at[(tp, size, lo, hi, key)]
        for ref in (lo, hi):
            if (tp, ref, key) not in self._priced:
                self._priced[(tp, ref, key)] = self.costs(tp, ref, key) if key is not None else self.costs(tp, ref)
        self._at[(tp, size, lo, hi, key)] = costs = self._priced[(tp, lo, key)].at(size, self._priced[(tp, hi, key)])
        return costs

    def split(self, c: Candidate, tp: int, placement: tuple[int, ...]) -> Split | None:
        """The fullest rank's shares under the candidate's own split of the priced graph (one per
        partitioner option and placement: the shares hardly move with tp or the micro-batch size);
        a partitioner declaring `estimated_as` (milp: its search takes seconds) by that one's.
        None where it cannot cut this placement (the plan says why) or without a graph."""
        if self.graph is None:
            return None
        experts = self.experts(c)
        key = (c.partitioner, placement, experts)
        if key not in self._splits:
            plugin = c.partitioner_plugin
            stand_in = plugin.attribute("estimated_as", None)
            if stand_in is not None:
                plugin = replace(plugin, fn=stand_in, kwargs={}, args=())
            try:
                size = self.reference.get(tp, (1, 1))[0]
                graph = self.graph(tp, size, experts) if experts is not None else self.graph(tp, size)
                part = partition_graph(plugin, graph, placement, PartitionRequest(1.0, [1] * len(placement)))
            except ConfigError:
                self._splits[key] = None
            else:
                self._splits[key] = Split.of(part, placement)
        return self._splits[key]

    def estimate(self, c: Candidate, exact: bool = False) -> Estimate:
        """`c`'s estimate; `exact`: its schedule's shape simulated at its own size where that is
        within EXACT_STAGE_MICROBATCHES (else scaled from a small pipeline, as for every other)."""
        pp, _, tp = self._layout(c)
        if c.remat == "auto" and self.cap is not None and not c.partitioner_plugin.attribute("chooses_remat", True):
            return Estimate(error=f"remat=auto under a memory budget needs a partitioner that chooses the stages to "
                                  f"recompute while cutting; partitioner={c.partitioner} does not")
        try:
            assert self.generator is not None, "the search sets the generators"
            gen = self.generator(c)
            placement = placement_for(gen, pp)
            if len(placement) * c.microbatches <= CHECKED_ACTIONS:  # larger: checked when planned
                gen.check(pp, c.microbatches, placement)
            model = self.model_costs(tp, self.micro_batch_size(c), self.experts(c))
            if len(placement) > model.nodes:
                return Estimate(error=f"{len(placement)} pipeline stages need at least as many graph nodes, and the "
                                      f"traced model has {model.nodes}")
            backward = min(model.input_grad + model.weight_grad, model.backward) if gen.split_backward \
                else model.backward
            whole = model.forward + backward
            if whole <= 0:
                return Estimate(error="the profile prices nothing")
            # the shape on a transformer's usual F:I:W (1:1:1; a fused B twice F): the bubble in
            # units of a rank's work hardly moves with the ratio, and one measurement serves every
            # tp degree and micro-batch size
            fiw = (1.0, 1.0, 1.0) if gen.split_backward else (1.0, 2.0, 0.0)
            remat = c.remat if c.remat in ("stage", "full", "selective") else "none"
            exact = exact and len(placement) * c.microbatches <= EXACT_STAGE_MICROBATCHES
            shaped = schedule_shape if exact else scaled_shape
            shape = shaped(gen, pp, c.microbatches, "stage" if remat == "stage" else "none", fiw)
        except ConfigError as err:
            return Estimate(error=str(err).removeprefix("Invalid config "))
        stages = len(placement)
        split = self.split(c, tp, tuple(placement)) if pp > 1 else None
        step = self._step(c, model, shape, remat, whole, split, gen.split_backward)
        memory = self._peak(c, model, shape, remat, stages, split)
        if c.remat == "auto" and self.cap is not None and memory.peak_bytes > self.cap:
            # recompute where needed: every block selectively, or whole, as the blocks' choice would at most
            for mode in ("selective", "full"):
                kept = self._peak(c, model, shape, mode, stages, split)
                if kept.peak_bytes <= self.cap or mode == "full":
                    return replace(kept, step_s=self._step(c, model, shape, mode, whole, split, gen.split_backward))
        if remat == "stage" and gen.split_backward:
            # a split backward keeps a recomputed micro-batch's activations from its I until its W,
            # which these schedules defer: its memory is estimated as without recomputation
            return replace(self._peak(c, model, shape, "none", stages, split), step_s=step)
        return replace(memory, step_s=step)

    def _step(self, c: Candidate, model: ModelCosts, shape: Shape, remat: str, whole: float,
              split: Split | None = None, split_backward: bool = False) -> float:
        pp, dp = self._layout(c)[0], self._replicas(c)  # dp x cp ranks reduce the gradients
        # a whole stage reruns once (R); a recomputed block once in a fused backward, in each half of a split one
        rerun = model.forward if remat == "stage" else model.recompute(remat)[1] * (2 if split_backward else 1)
        work = whole + rerun
        if split is not None:  # the fullest rank of the candidate's own split
            work *= split.work
        else:  # an even split, a stage holding at least its largest node
            work = max(work / pp, model.largest_work)
        (latency, bandwidth), dp_link = self.links(c)
        hops = 2 * (pp - 1) * (latency + model.boundary_bytes / bandwidth) if pp > 1 else 0.0
        # an ep rank's experts are stepped (sharded) and reduced over their dp / ep expert replicas only
        experts, replicas = model.expert_bytes / pp, dp // self._ep(c)
        rank_params = model.param_bytes / pp - experts
        level = self.configured_zero if c.zero is None else c.zero
        optimizer = self.optimizer_s_per_byte * (rank_params / (dp if level >= 1 and dp > 1 else 1)
                                                 + experts / (replicas if level >= 1 and replicas > 1 else 1))
        reduce = 0.0
        if dp > 1:
            lat, bw = dp_link if dp_link is not None else (latency, bandwidth)
            ring = 2 * (dp - 1) / dp * rank_params / bw + 2 * (dp - 1) * lat
            if replicas > 1 and experts > 0:
                ring += 2 * (replicas - 1) / replicas * experts / bw + 2 * (replicas - 1) * lat
            reduce = max(0.0, ring - (whole - model.forward) / pp)  # hidden under the last backward
        return (c.microbatches + shape.bubble) * work + hops + optimizer + reduce

    def _peak(self, c: Candidate, model: ModelCosts, shape: Shape, remat: str, stages: int,
              split: Split | None = None) -> Estimate:
        """The fullest device's bytes (no step yet): its parameters, gradients and optimizer
        state, then the larger of the activations it holds in the step and the update's
        temporaries after it, priced as the prediction prices them (UpdateMemory)."""
        pp, dp = self._layout(c)[0], self._replicas(c)  # dp x cp ranks shard the states
        level = self.configured_zero if c.zero is None else c.zero
        rank_params = model.param_bytes * split.params if split is not None else \
            model.param_bytes / pp + (model.largest_params if pp > 1 else 0.0)
        # of them an ep rank's experts (their share of the whole), sharded over the dp / ep expert
        # replicas holding the same ones where the rest is over all dp
        experts = rank_params * model.expert_bytes / model.param_bytes if model.param_bytes > 0 else 0.0
        shard, expert_shard = max(1, dp), max(1, dp // self._ep(c))

        def sharded_at(lowest: int) -> float:  # what is left of the rank's bytes once `lowest` shards them
            return (rank_params - experts) / (shard if level >= lowest else 1) + \
                experts / (expert_shard if level >= lowest else 1)

        weights, grads, states = sharded_at(3), sharded_at(2), self.optimizer_states * sharded_at(1)
        per_stage = model.saved_bytes / stages  # one stage's activations for one micro-batch
        kept, _, buffer = model.recompute(remat)  # recomputed blocks: what a micro-batch keeps, one rerun's
        if remat == "stage":  # stage inputs held, one stage's activations rebuilt at a time
            held = shape.held * (stages / pp) * model.boundary_bytes + per_stage
        elif split is not None:  # the micro-batches a rank holds, of its own stages' activations
            held = shape.held * kept * split.activations + buffer
        else:
            held = shape.held * (stages / pp) * kept / stages + buffer
        stepped = shard if level >= 1 else 1  # the optimizer steps a shard of the parameters
        update = UpdateMemory(temporaries=self.optimizer_temporaries, dp=dp).bytes(
            sharded_at(1), min(model.largest_tensor, rank_params), stepped)
        state = weights + grads + states + self.reserve_bytes
        return Estimate(peak_bytes=state + max(held, update), activation_bytes=held, update_bytes=update,
                        state_bytes=state)


def activation_scale(simulated: list[tuple[Estimate, float]]) -> float:
    """What the simulated candidates' activations came to over their estimates', from (estimate,
    simulated peak) pairs: the median ratio, never below 1. The estimate counts a graph node's saved
    bytes; an op-level graph (a transformers model traced to aten ops) saves more in the places a
    simulation sees, and every candidate of one model is off by about the same factor."""
    ratios = sorted((peak - (e.peak_bytes - e.activation_bytes)) / e.activation_bytes
                    for e, peak in simulated if e.error is None and e.activation_bytes > e.update_bytes)
    return max(1.0, ratios[len(ratios) // 2]) if ratios else 1.0


def refined(order: list[Candidate], estimate_of: dict[int, Estimate], screen: Screen, top: int,
            cap: float | None, scale: float = 1.0, given: Candidate | None = None) -> list[Candidate]:
    """`order` (fastest estimate first, `given` at the front) with its first `top` candidates
    estimated on their exact schedule shapes (`Screen.estimate(exact=True)`), again until the
    first `top` all are: a schedule whose bubble grows faster than its small pipeline's scaled
    (V-Half and V-Min at pp=24: 4x) falls back among the others, and one now over the memory drops
    out. `estimate_of` (by id) is updated."""
    exact: set[int] = set()
    while todo := [c for c in order[:top] if id(c) not in exact and c is not given]:
        for c in todo:
            estimate_of[id(c)] = screen.estimate(c, exact=True)
            exact.add(id(c))
        rest = sorted((c for c in order if c is not given and estimate_of[id(c)].fits(cap, scale)),
                      key=lambda c: (estimate_of[id(c)].step_s, estimate_of[id(c)].peak_bytes))
        order = [given, *rest] if given is not None and given in order else rest
    return order


def ranked(cands: list[Candidate], screen: Screen, given: Candidate | None
           ) -> tuple[list[Candidate], list[tuple[Candidate, Estimate]]]:
    """The candidates estimated to fit, fastest estimate first (the configuration as given at the
    front), and every candidate with its estimate. A remat=auto candidate whose estimate is its
    remat=none twin's (nothing to recompute) is left out of the order: it would plan the same."""
    estimates = [(c, screen.estimate(c)) for c in cands]
    order = sorted((i for i, (_, e) in enumerate(estimates) if e.fits(screen.cap)),
                   key=lambda i: (estimates[i][1].step_s, estimates[i][1].peak_bytes, i))
    out: list[Candidate] = [given] if given is not None else []
    seen: set[tuple] = set()
    for i in order:
        c, e = estimates[i]
        twin = (c.scheduler, c.partitioner, c.microbatches, c.zero, c.reshard, c.pp, c.dp, c.tp, c.cp, e.step_s,
                e.peak_bytes)
        if twin not in seen and c is not given:
            seen.add(twin)
            out.append(c)
    return out, estimates
