"""What `plan=auto` and `scheduler=auto` compare: the candidates built from the config groups'
options, and one planning call per candidate.

`scheduler=auto` is the same search with only the schedule varying. The options of the
scheduler and partitioner groups come from the launcher (`GroupOptions`: every option on the
run's search path, a user's own too), never from a list kept in code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import networkx as nx
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate

from pipelaunch.pipeline.core.config import TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.planner.build import plugin_name
from pipelaunch.pipeline.planner.fit.under_cap import fit_budget
from pipelaunch.pipeline.planner.measure.traced import TracedModels, micro_batch_size
from pipelaunch.pipeline.planner.predict.prediction import Prediction, predict
from pipelaunch.pipeline.planner.schedules.base import ScheduleGenerator
from pipelaunch.pipeline.planner.search.choose import (
    Candidate,
    SearchResult,
    candidates,
    microbatch_counts,
    remat_values,
    run_search,
    scheduler_variants,
)


@dataclass(frozen=True)
class GroupOptions:
    """Every option of the `scheduler` and `partitioner` config groups (name -> its YAML as a
    dict), as the launcher found them on this run's search path."""

    scheduler: Mapping[str, dict] = field(default_factory=dict)
    partitioner: Mapping[str, dict] = field(default_factory=dict)


def is_auto(scheduler_cfg: Mapping) -> bool:
    """Whether the scheduler option is `scheduler=auto` (search the schedules)."""
    return str(scheduler_cfg.get("_target_", "")).endswith("AutoSchedule")


def training_schedules(options: GroupOptions) -> dict[str, dict]:
    """Training schedules of the scheduler config group (a user's own on the search path too):
    the options whose class trains (`training`), leaving out `auto` itself."""
    from pipelaunch.pipeline.planner.schedules.auto import AutoSchedule

    def trains(option: Mapping) -> bool:
        cls = _generator_class(option)
        return cls is None or (not issubclass(cls, AutoSchedule) and bool(getattr(cls, "training", True)))

    return {name: opt for name, opt in options.scheduler.items() if trains(opt)}


def _generator_class(option: Mapping) -> type | None:
    """The class a scheduler option names, or None when it does not import (instantiate_scheduler
    names the error if that option is chosen)."""
    try:
        return get_class(str(option.get("_target_")))
    except Exception:  # noqa: BLE001 - any import failure is reported when the option is built
        return None


def _searched_by_default(option: Mapping) -> bool:
    return bool(getattr(_generator_class(option), "searched_by_default", True))


def instantiate_scheduler(option: str, option_cfg: Mapping) -> ScheduleGenerator:
    try:
        gen = instantiate({k: v for k, v in option_cfg.items() if k != "name"})
    except InstantiationException as exc:
        raise ConfigError(f"scheduler ({option})", f"could not build {option_cfg.get('_target_')}: "
                                                   f"{exc.__cause__ or exc}") from exc
    if not isinstance(gen, ScheduleGenerator):
        raise ConfigError(f"scheduler ({option})", f"{option_cfg.get('_target_')} is not a ScheduleGenerator")
    return gen


def search_space(cfg: TrainConfig, options: GroupOptions, graph: nx.DiGraph
                 ) -> tuple[list[Candidate], Candidate | None]:
    """The candidates of `plan=auto` (or of `scheduler=auto`: only the schedule varies) and the
    one the config names as given, when it names a concrete one."""
    space = cfg.plan
    schedules = training_schedules(options)
    if not schedules:
        raise ConfigError("scheduler", "no training schedule found in the scheduler config group")
    # what a search tries unless `plan.schedulers` names its schedules: those whose predictions
    # hold (a generator with `searched_by_default = False` says why not in its docstring)
    default = {name: opt for name, opt in schedules.items() if _searched_by_default(opt)} or schedules
    given_part = {plugin_name(cfg.partitioner): dict(cfg.partitioner)}
    remat = str(cfg.remat)
    if not space.search:  # scheduler=auto alone
        return candidates(scheduler_variants(default, None, None), given_part, [cfg.microbatches], [remat]), None
    chosen = scheduler_variants(schedules if space.schedulers else default, space.schedulers, space.variants)
    partitioners = _partitioners(space.partitioners, options, graph)
    counts = microbatch_counts(cfg.pp, cfg.dp, cfg.batch_size, cfg.microbatches, space.microbatches)
    rematting = [str(r) for r in space.remat] if space.remat else None
    cands = candidates(chosen, partitioners, counts, remat_values(rematting, cfg.memory.cap_bytes is not None))
    given = None
    if not is_auto(cfg.scheduler):
        given = next((c for c in cands if c.scheduler_cfg.get("_target_") == cfg.scheduler.get("_target_")
                      and all(c.scheduler_cfg.get(k) == v for k, v in cfg.scheduler.items() if k != "name")
                      and c.partitioner == plugin_name(cfg.partitioner) and c.microbatches == cfg.microbatches
                      and c.remat == remat), None)
    return cands, given


def _partitioners(names: list[str], options: GroupOptions, graph: nx.DiGraph) -> dict[str, dict]:
    """The partitioner options `plan.partitioners` names (milp dropped on a chain, where the
    contiguous optimum is balanced's: the same split, slower)."""
    names = list(names)
    unknown = [n for n in names if n not in options.partitioner]
    if unknown:
        raise ConfigError("plan.partitioners", f"unknown partitioner option(s) {unknown}; valid: "
                                               f"{sorted(options.partitioner)}")
    if "milp" in names and _is_chain(graph) and "balanced" in names:
        names.remove("milp")
    return {n: dict(options.partitioner[n]) for n in names}


def _is_chain(graph: nx.DiGraph) -> bool:
    return graph.number_of_edges() == graph.number_of_nodes() - 1 and all(
        graph.in_degree(n) <= 1 and graph.out_degree(n) <= 1 for n in graph.nodes)


def search(cfg: TrainConfig, models: TracedModels, build: Callable[..., Plan], cands: list[Candidate],
           given: Candidate | None, link: tuple[float, float]) -> SearchResult:
    """Plan, simulate and fit every candidate; `build(generator, traced, candidate)` makes its Plan
    (`build(generator, traced, candidate, whole)` with those stages recomputing whole, which
    remat=auto's fit asks for); `link`: the (latency, bandwidth) the predictions price."""
    cap = cfg.memory.cap_bytes

    generators: dict[str, ScheduleGenerator] = {}  # one frozen value per scheduler option (and variant)

    def evaluate(c: Candidate) -> Prediction:
        if c.scheduler not in generators:
            generators[c.scheduler] = instantiate_scheduler(c.scheduler, dict(c.scheduler_cfg))
        gen = generators[c.scheduler]
        traced = models.get(micro_batch_size(cfg, c.microbatches))
        plan = build(gen, traced, c)
        return fit_budget(plan, predict(plan, *link), traced.graph, cap, *link,
                          rebuild=lambda whole: build(gen, traced, c, whole))

    tie = cfg.plan.tie
    if not 0.0 <= tie < 1.0:
        raise ConfigError("plan.tie", f"got {tie}; valid: a share of the fastest prediction in [0, 1), e.g. 0.03")
    return run_search(cands, evaluate, cap, given, tie)
