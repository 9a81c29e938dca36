"""Drive `plan=auto` and `scheduler=auto` from a resolved config: the search space from the config
groups, a traced and profiled model per micro-batch size, and one planning call per candidate.

`scheduler=auto` is the same search with only the schedule varying.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import networkx as nx
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from launcher.config import group_configs
from models.spec import ModelSpec
from pipeline.core.errors import ConfigError
from pipeline.core.plan import Plan
from pipeline.graph.trace import TracedModel
from pipeline.planner import plugin_name
from pipeline.planner.fit import fit_budget
from pipeline.planner.predict import Prediction, predict, profiling_threads
from pipeline.planner.profile import apply_profile, profile_graph, profiled_nodes
from pipeline.planner.schedules.base import ScheduleGenerator
from pipeline.planner.search import (
    Candidate,
    SearchResult,
    candidates,
    microbatch_counts,
    remat_values,
    run_search,
    scheduler_variants,
)
from pipeline.runtime.context import cpu_threads
from pipeline.runtime.host_allocator import configure_host_allocator

#: scheduler options that are not a training schedule to compare
NOT_CANDIDATES = ("AutoSchedule", "Inference")


class TracedModels:
    """The model traced (and, with `profile`, measured) once per micro-batch size: a candidate with
    more micro-batches runs smaller ones, whose per-op times do not scale linearly.

    Measured on the device the run trains on. On the CPU, here. On a GPU, `device` is the rank's
    own GPU when this runs inside a rank (rank 0 of ranks torchrun or SLURM started, which plans
    for all); in the launcher (`device=None` for a GPU run) the profile is taken by a child process
    on cuda:0, the GPU local rank 0 will train on, which ends before any rank starts, so that the
    launcher itself never opens a CUDA context (it would hold GPU memory on GPU 0 for the whole
    run)."""

    def __init__(self, spec: ModelSpec, cfg: dict, profile: bool, cuda: bool = False,
                 device: torch.device | None = None) -> None:
        self.spec, self.cfg, self.profile = spec, cfg, profile
        #: where to profile: this process's device (None: a child process on cuda:0)
        self.device = device if device is not None else (None if cuda else torch.device("cpu"))
        self.model = None
        self._traced: dict[int, TracedModel] = {}

    def get(self, micro_batch_size: int) -> TracedModel:
        if micro_batch_size not in self._traced:
            try:
                if self.model is None:
                    self.model = self.spec.build_meta()
                traced = self.spec.trace(micro_batch_size, self.model)
            except ConfigError:
                raise
            except Exception as err:  # noqa: BLE001 - a model that cannot be built from these values
                raise ConfigError("model", f"model={self.spec.name} could not be built and traced with these "
                                           f"options: {type(err).__name__}: {err}") from err
            if self.profile:
                if self.device is None:
                    nodes, cached = profile_in_child(self.cfg, micro_batch_size, torch.device("cuda", 0))
                    apply_profile(traced.graph, nodes)
                    traced.graph.graph["profile_cached"] = cached
                else:
                    profile_traced(self.spec, self.cfg, traced, micro_batch_size, self.device)
            self._traced[micro_batch_size] = traced
        return self._traced[micro_batch_size]


def profile_traced(spec: ModelSpec, cfg: dict, traced: TracedModel, micro_batch_size: int,
                   device: torch.device) -> None:
    """Measure `traced` on one real micro-batch on `device` (cached on disk)."""
    x, y = spec.example_batch(micro_batch_size, cfg["seed"])
    if device.type == "cuda":
        # what CPU profiles add to the key (threads, malloc) does not change a GPU's timings;
        # the GPU's name does (profile_key)
        profile_graph(traced, (x,), device=device, loss=(spec.loss_fn, y), seed=cfg["seed"],
                      model_config={"model": cfg["model"]})
        return
    # Timed as the ranks will run: their thread count, and their malloc (with glibc's defaults an
    # 8 MiB logits buffer is mapped afresh on some repeats and not on others: the head measured
    # 1.22-1.49x a block, 1.25-1.27x with freed memory kept).
    allocator = cfg.get("host_allocator", "retain")
    threads = cpu_threads(cfg.get("threads", 0), cfg["pp"] * cfg["dp"])
    configure_host_allocator(allocator)
    with profiling_threads(threads):
        profile_graph(traced, (x,), device=device, loss=(spec.loss_fn, y), seed=cfg["seed"],
                      model_config={"model": cfg["model"], "threads": threads, "host_allocator": allocator})


def profile_in_child(cfg: dict, micro_batch_size: int, device: torch.device) -> tuple[dict[str, dict], bool]:
    """Profile the model of `cfg` on `device` in a fresh process that exits before this returns,
    taking its CUDA context with it; returns every node's profile fields and whether the on-disk
    cache had them."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_profile_child, cfg, micro_batch_size, str(device)).result()


def _profile_child(cfg: dict, micro_batch_size: int, device: str) -> tuple[dict[str, dict], bool]:
    """The child's side: rebuild and retrace the model (deterministic: the same node names), then
    profile it on its GPU."""
    spec = instantiate(cfg["model"])
    traced = spec.trace(micro_batch_size, spec.build_meta())
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    profile_traced(spec, cfg, traced, micro_batch_size, torch.device(device))
    return profiled_nodes(traced.graph), bool(traced.graph.graph.get("profile_cached"))


def micro_batch_size(cfg: dict, microbatches: int) -> int:
    """Sequences per micro-batch when each replica's share of the batch is cut into `microbatches`."""
    return cfg["batch_size"] // (cfg["dp"] * microbatches)


def scheduler_options(cfg: dict) -> dict[str, dict]:
    """Training schedules of the scheduler config group (a user's own on the search path too)."""
    options = (cfg.get("plan") or {}).get("scheduler_options") or group_configs("scheduler")
    return {name: opt for name, opt in options.items()
            if not str(opt.get("_target_", "")).endswith(NOT_CANDIDATES)}


def instantiate_scheduler(option: str, option_cfg: dict) -> ScheduleGenerator:
    try:
        gen = instantiate({k: v for k, v in option_cfg.items() if k != "name"})
    except InstantiationException as exc:
        raise ConfigError(f"scheduler ({option})", f"could not build {option_cfg.get('_target_')}: "
                                                   f"{exc.__cause__ or exc}") from exc
    if not isinstance(gen, ScheduleGenerator):
        raise ConfigError(f"scheduler ({option})", f"{option_cfg.get('_target_')} is not a ScheduleGenerator")
    return gen


def search_space(cfg: dict, graph: nx.DiGraph, auto_scheduler: bool) -> tuple[list[Candidate], Candidate | None]:
    """The candidates of `plan=auto` (or of `scheduler=auto`: only the schedule varies) and the
    one the config names as given, when it names a concrete one."""
    space = cfg.get("plan") or {}
    options = scheduler_options(cfg)
    if not options:
        raise ConfigError("scheduler", "no training schedule found in the scheduler config group")
    given_part = {plugin_name(cfg["partitioner"]): dict(cfg["partitioner"])}
    if not space.get("search"):  # scheduler=auto alone
        return candidates(scheduler_variants(options, None, None), given_part, [cfg["microbatches"]],
                          [cfg["remat"]]), None
    schedulers = scheduler_variants(options, space.get("schedulers"), space.get("variants"))
    all_partitioners = space.get("partitioner_options") or group_configs("partitioner")
    names = list(space.get("partitioners") or ["uniform", "balanced", "milp"])
    unknown = [n for n in names if n not in all_partitioners]
    if unknown:
        raise ConfigError("plan.partitioners", f"unknown partitioner option(s) {unknown}; valid: "
                                               f"{sorted(all_partitioners)}")
    if "milp" in names and _is_chain(graph) and "balanced" in names:
        names.remove("milp")  # on a chain the contiguous optimum is balanced's: the same split, slower
    partitioners = {n: dict(all_partitioners[n]) for n in names}
    counts = microbatch_counts(cfg["pp"], cfg["dp"], cfg["batch_size"], cfg["microbatches"], space.get("microbatches"))
    cands = candidates(schedulers, partitioners, counts, remat_values(space.get("remat"), _cap(cfg) is not None))
    given = None
    if not str(cfg["scheduler"].get("_target_", "")).endswith("AutoSchedule"):
        given = next((c for c in cands if c.scheduler_cfg.get("_target_") == cfg["scheduler"].get("_target_")
                      and all(c.scheduler_cfg.get(k) == v for k, v in cfg["scheduler"].items() if k != "name")
                      and c.partitioner == plugin_name(cfg["partitioner"]) and c.microbatches == cfg["microbatches"]
                      and c.remat == cfg["remat"]), None)
    return cands, given


def _cap(cfg: dict) -> float | None:
    cap = (cfg.get("memory") or {}).get("cap_bytes")
    return None if cap is None else float(cap)


def _is_chain(graph: nx.DiGraph) -> bool:
    return graph.number_of_edges() == graph.number_of_nodes() - 1 and all(
        graph.in_degree(n) <= 1 and graph.out_degree(n) <= 1 for n in graph.nodes)


def search(cfg: dict, models: TracedModels, build, cands: list[Candidate], given: Candidate | None,
           link: tuple[float, float]) -> SearchResult:
    """Plan, simulate and fit every candidate; `build(generator, traced, candidate)` makes its Plan."""
    cap = _cap(cfg)

    def evaluate(c: Candidate) -> Prediction:
        gen = instantiate_scheduler(c.scheduler, dict(c.scheduler_cfg))  # fresh: cost-aware ones keep costs
        traced = models.get(micro_batch_size(cfg, c.microbatches))
        plan: Plan = build(gen, traced, c)
        return fit_budget(plan, predict(plan, *link), traced.graph, cap, *link)

    tie = (cfg.get("plan") or {}).get("tie") or 0.0
    if isinstance(tie, bool) or not isinstance(tie, (int, float)) or not 0.0 <= tie < 1.0:
        raise ConfigError("plan.tie", f"got {tie}; valid: a share of the fastest prediction in [0, 1), e.g. 0.03")
    return run_search(cands, evaluate, cap, given, tie)
