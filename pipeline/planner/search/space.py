"""What `plan=auto` and `scheduler=auto` compare: the candidates built from the config groups'
options, and one planning call per candidate.

`scheduler=auto` is the same search with only the schedule varying (`Plugins.search_schedules`).
The options of the scheduler and partitioner groups come from the launcher, built (`GroupOptions`:
every option on the run's search path, a user's own too), never from a list kept in code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import networkx as nx

from pipelaunch.pipeline.core.config import TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.core.plugins import GroupOptions, Plugin, Plugins
from pipelaunch.pipeline.planner.fit.under_cap import fit_budget
from pipelaunch.pipeline.planner.measure.traced import TracedModels, micro_batch_size
from pipelaunch.pipeline.planner.partition.atomic import contract_unsendable
from pipelaunch.pipeline.planner.predict.prediction import Prediction, predict
from pipelaunch.pipeline.planner.schedules.base import ScheduleGenerator
from pipelaunch.pipeline.planner.search.choose import (
    Candidate,
    Outcome,
    SearchResult,
    candidates,
    remat_values,
    reshard_values,
    run_search,
    scheduler_variants,
)
from pipelaunch.pipeline.planner.search.layouts import layouts
from pipelaunch.pipeline.planner.search.screen import (
    DEFAULT_SIMULATED,
    SIMULATE_ALL,
    TRIES,
    Estimate,
    Screen,
    activation_scale,
    ranked,
    refined,
)


def training_schedules(options: GroupOptions) -> dict[str, Plugin]:
    """Training schedules of the scheduler config group (a user's own on the search path too): the
    options whose class trains (`training`; one that cannot be built is kept, to report why)."""
    return {name: opt for name, opt in options.scheduler.items() if opt.attribute("training", True)}


def build_generator(option: Plugin) -> ScheduleGenerator:
    """The generator a scheduler option names: a frozen value, built once and reused for every
    candidate and rebuild (its costs are arguments of `compute_actions`)."""
    gen = option.build()
    if not isinstance(gen, ScheduleGenerator):
        raise ConfigError(f"scheduler ({option.option})", f"{option.path} is not a ScheduleGenerator")
    return gen


def search_space(cfg: TrainConfig, plugins: Plugins, options: GroupOptions, graph: nx.DiGraph,
                 tps: Sequence[int] = (1,), experts: int = 0,
                 cps: Sequence[int] | None = None) -> tuple[list[Candidate], Candidate | None]:
    """The candidates of `plan=auto` (or of `scheduler=auto`: only the schedule varies) and the
    one the config names as given, when it names a concrete one; `experts`: the model's routed
    experts per layer (under plan.devices each layout is also tried at its expert-parallel degrees);
    `cps`: the context-parallel degrees each layout is tried at (None: the configured cp)."""
    space = cfg.plan
    schedules = training_schedules(options)
    if not schedules:
        raise ConfigError("scheduler", "no training schedule found in the scheduler config group")
    # what a search tries unless `plan.schedulers` names its schedules: those whose predictions
    # hold (a generator with `searched_by_default = False` says why not in its docstring)
    default = {name: opt for name, opt in schedules.items() if opt.attribute("searched_by_default", True)} or schedules
    given_part = {plugins.partitioner.option: plugins.partitioner}
    remat = str(cfg.remat)
    if not space.search:  # scheduler=auto alone
        return candidates(scheduler_variants(default, None, None), given_part, [cfg.microbatches], [remat]), None
    chosen = scheduler_variants(schedules if space.schedulers else default, space.schedulers, space.variants)
    partitioners = _partitioners(space.partitioners or [plugins.partitioner.option], options, graph)
    rematting = [str(r) for r in space.remat] if space.remat else None
    remats = remat_values(rematting, cfg.memory.cap_bytes is not None)
    reshards = reshard_values(space.reshard)
    cands = [c for lay in layouts(cfg, tps, experts, cps)
             for c in candidates(chosen, partitioners, lay.counts, remats, lay.zeros, (lay.pp, lay.dp), reshards,
                                 cfg.zero, lay.tp if lay.pp is not None else None, lay.ep, lay.cp)]
    given, named = None, plugins.scheduler
    if named is not None:
        given = next((c for c in cands if c.scheduler_plugin.same_as(named)
                      and c.partitioner == plugins.partitioner.option and c.microbatches == cfg.microbatches
                      and c.remat == remat and c.zero in (None, cfg.zero) and c.reshard in (None, str(cfg.reshard))
                      and (c.pp is None or (c.pp, c.dp, c.tp) == (cfg.pp, cfg.dp, cfg.tp))
                      and c.ep in (None, cfg.ep) and c.cp in (None, cfg.cp)), None)
    return cands, given


def _partitioners(names: list[str], options: GroupOptions, graph: nx.DiGraph) -> dict[str, Plugin]:
    """The partitioner options `plan.partitioners` names; on a chain, those whose split there is
    another chosen one's (`same_split_on_a_chain`: milp finds balanced's split, slower) are left out."""
    unknown = [n for n in names if n not in options.partitioner]
    if unknown:
        raise ConfigError("plan.partitioners", f"unknown partitioner option(s) {unknown}; valid: "
                                               f"{sorted(options.partitioner)}")
    chosen = {n: options.partitioner[n] for n in names}
    contraction = contract_unsendable(graph)  # what the partitioners cut: an export trace's layers as units
    if _is_chain(graph if contraction is None else contraction.graph):
        fns = {p.fn for p in chosen.values()}
        chosen = {n: p for n, p in chosen.items() if p.attribute("same_split_on_a_chain", None) not in fns}
    return chosen


def _is_chain(graph: nx.DiGraph) -> bool:
    return graph.number_of_edges() == graph.number_of_nodes() - 1 and all(
        graph.in_degree(n) <= 1 and graph.out_degree(n) <= 1 for n in graph.nodes)


def search(cfg: TrainConfig, models: TracedModels, build: Callable[..., Plan], cands: list[Candidate],
           given: Candidate | None, link: Callable[[Candidate], tuple[float, float]],
           screen: Screen | None = None,
           expert_layout: Callable[[Candidate], dict] = lambda c: {}) -> SearchResult:
    """Plan, simulate and fit every candidate; `build(generator, traced, candidate)` makes its Plan
    (`build(generator, traced, candidate, whole)` with those stages recomputing whole, which
    remat=auto's fit asks for); `link(candidate)`: the pipeline link's (latency, bandwidth) the
    predictions price for its layout; `expert_layout(candidate)`: the expert- and context-parallel
    degrees and links its trace is priced at (`TracedModels.get`'s `ep`, `ep_link`, `cp`, `cp_link`). With a `screen` and more
    candidates than `plan.simulate` allows, only the most promising by its closed-form estimates
    are planned (search/screen.py)."""
    cap = cfg.memory.cap_bytes
    generators: dict[str, ScheduleGenerator] = {}  # one frozen value per scheduler option (and variant)

    def generator(c: Candidate) -> ScheduleGenerator:
        if c.scheduler not in generators:
            generators[c.scheduler] = build_generator(c.scheduler_plugin)
        return generators[c.scheduler]

    def evaluate(c: Candidate) -> Prediction:
        gen = generator(c)
        traced = models.get(micro_batch_size(cfg, c.microbatches, c.dp), c.tp, **expert_layout(c))
        plan = build(gen, traced, c)
        return fit_budget(plan, predict(plan, *link(c), collectives=False), traced.graph, cap, *link(c),
                          rebuild=lambda whole: build(gen, traced, c, whole))

    tie = cfg.plan.tie
    if not 0.0 <= tie < 1.0:
        raise ConfigError("plan.tie", f"got {tie}; valid: a share of the fastest prediction in [0, 1), e.g. 0.03")
    started = time.perf_counter()
    limit = cfg.plan.simulate
    if limit is not None and (isinstance(limit, bool) or limit < 1):
        raise ConfigError("plan.simulate", f"got {limit!r}; valid: a positive number of candidates, or null")
    if screen is not None and (len(cands) > limit if limit is not None else
                               screen.by_default and len(cands) > SIMULATE_ALL):
        return _screened_search(cfg, models, cands, given, screen, generator, evaluate,
                                DEFAULT_SIMULATED if limit is None else limit, started)
    _prepare(cfg, models, cands)
    return run_search(cands, evaluate, cap, given, tie, started=started)


def _prepare(cfg: TrainConfig, models: TracedModels, cands: Sequence[Candidate]) -> None:
    """Every size the candidates run, measured in shared passes (the machine's drift between
    profiles taken one after another decided between micro-batch counts)."""
    for tp, ep, cp in sorted({(c.tp, c.ep, c.cp) for c in cands}, key=lambda k: tuple(x or 0 for x in k)):
        try:
            models.prepare((s for s in {micro_batch_size(cfg, c.microbatches, c.dp) for c in cands
                                        if (c.tp, c.ep, c.cp) == (tp, ep, cp)} if s >= 1), tp, ep, cp)
        except ConfigError:
            pass  # a size (or tp) the model cannot be traced at fails its own candidates below


def _may_win(outcomes: list[Outcome], estimate: Estimate | None) -> bool:
    """Whether the next candidate, estimated at `estimate`, may still beat the fastest planned one
    that fits: its estimate is under that one's simulated step (an estimate that missed a
    recomputation the simulation had to add is undercut by the next best estimates)."""
    steps = [o.prediction.step_s for o in outcomes if o.fits]
    return estimate is not None and bool(steps) and estimate.step_s < min(steps)


def _screened_search(cfg: TrainConfig, models: TracedModels, cands: list[Candidate], given: Candidate | None,
                     screen: Screen, generator: Callable[[Candidate], ScheduleGenerator],
                     evaluate: Callable[[Candidate], Prediction], keep: int, started: float) -> SearchResult:
    """Candidates planned in the order of their closed-form estimates (search/screen.py) until
    `keep` of them fit the budget (at most TRIES x keep planned); the rest are reported with their
    estimates, not planned."""
    sizes: dict[int, tuple[int, int]] = {}
    for c in cands:
        tp, size = c.tp or cfg.tp, micro_batch_size(cfg, c.microbatches, c.dp)
        if size >= 1:
            lo, hi = sizes.get(tp, (size, size))
            sizes[tp] = (min(lo, size), max(hi, size))
    screen = replace(screen, generator=generator, reference=sizes)
    order, estimates = ranked(cands, screen, given)
    estimate_of = {id(c): e for c, e in estimates}
    outcomes: list[Outcome] = []
    scale = 1.0
    while order and len(outcomes) < TRIES * keep and (sum(o.fits for o in outcomes) < keep or
                                                     _may_win(outcomes, estimate_of.get(id(order[0])))):
        wanted = max(1, min(keep - sum(o.fits for o in outcomes), TRIES * keep - len(outcomes)))
        order = refined(order, estimate_of, screen, wanted, cfg.memory.cap_bytes, scale, given)
        batch, order = order[:wanted], order[wanted:]
        _prepare(cfg, models, batch)
        for o in run_search(batch, evaluate, cfg.memory.cap_bytes).outcomes:
            o.estimate = estimate_of.get(id(o.candidate))
            outcomes.append(o)
        # the estimates corrected by what the simulations held: those now over the memory are left
        scale = activation_scale([(o.estimate, o.prediction.peak_bytes) for o in outcomes
                                  if o.prediction is not None and o.estimate is not None])
        order = [c for c in order
                 if id(c) not in estimate_of or estimate_of[id(c)].fits(cfg.memory.cap_bytes, scale)]
    planned = {id(o.candidate) for o in outcomes}
    result = SearchResult(outcomes, time.perf_counter() - started, cfg.memory.cap_bytes, given, cfg.plan.tie)
    result.screened = [(c, e) for c, e in estimates if id(c) not in planned]
    result.activation_scale = scale
    return result
