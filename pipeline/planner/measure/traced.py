"""The model traced on the meta device, and measured, once per micro-batch size.

A candidate with more micro-batches runs smaller ones, whose per-op times do not scale linearly,
so `plan=auto` asks for each size it tries. The profile is taken on the device the run trains on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import torch

from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.compute.host_allocator import configure_host_allocator
from pipelaunch.pipeline.compute.threads import cpu_threads
from pipelaunch.pipeline.compute.vocab_parallel import vocab_parallel_loss
from pipelaunch.pipeline.core.config import TrainConfig
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.hardware import Hardware
from pipelaunch.pipeline.core.plugins import Plugin
from pipelaunch.pipeline.core.precision import PRECISIONS
from pipelaunch.pipeline.graph.sequence_parallel import REPLICATED, SPLIT, SequenceRewrite, sequence_setup
from pipelaunch.pipeline.graph.tensor_parallel import (
    Rewritten,
    replicated_values,
    shard_meta,
    sharded_params,
    trace_local,
)
from pipelaunch.pipeline.graph.trace import TracedModel
from pipelaunch.pipeline.planner.measure.analytic_profile import price_graphs
from pipelaunch.pipeline.planner.measure.autocast import cached_autocast_dtypes
from pipelaunch.pipeline.planner.measure.context import add_context_costs
from pipelaunch.pipeline.planner.measure.experts import add_all_to_alls, ep_local
from pipelaunch.pipeline.planner.measure.host_memory import check_host_memory
from pipelaunch.pipeline.planner.measure.profile import (
    ProfileJob,
    apply_profile,
    profile_graphs,
    profiled_nodes,
)
from pipelaunch.pipeline.planner.measure.tensor_parallel import add_collectives, profiled_twin
from pipelaunch.pipeline.planner.predict.prediction import profiling_threads


class TracedModels:
    """The model traced (and, with `profile`, measured) once per micro-batch size: a candidate with
    more micro-batches runs smaller ones, whose per-op times do not scale linearly.

    Measured on the device the run trains on. On the CPU, here. On a GPU, `device` is the rank's
    own GPU when this runs inside a rank (rank 0 of ranks torchrun or SLURM started, which plans
    for all); in the launcher (`device=None` for a GPU run) the profile is taken by a child process
    on cuda:0, the GPU local rank 0 will train on, which ends before any rank starts, so that the
    launcher itself never opens a CUDA context (it would hold GPU memory on GPU 0 for the whole
    run)."""

    def __init__(self, spec: ModelSpec, model: Plugin, cfg: TrainConfig, profile: bool, cuda: bool = False,
                 device: torch.device | None = None, hardware: Hardware | None = None) -> None:
        #: `model` builds `spec` again in a child process (a GPU run's profile)
        self.spec, self.model_plugin, self.cfg, self.profile, self.cuda = spec, model, cfg, profile, cuda
        #: a hardware file: the profile is priced on its figures, on meta, in this process
        self.hardware = hardware
        #: where to profile: this process's device (None: a child process on cuda:0)
        self.device = device if device is not None else (None if cuda else torch.device("cpu"))
        self.model = None
        #: per expert-parallel degree, the model with one ep rank's experts (`ep_local`)
        self._models: dict[int, torch.nn.Module] = {}
        #: the whole model traced, per (micro-batch size, ep)
        self._traced: dict[tuple[int, int], TracedModel] = {}
        #: per (size, ep > 1, ep link): the trace with its all-to-alls priced on that link
        self._exchanged: dict[tuple[int, int, int, tuple[float, float]], TracedModel] = {}
        #: the tp degree a size is asked at by default (the configured one), the modules it splits
        #: (set by make_plan) and the tp link priced (latency, bandwidth)
        self.tp, self.tp_modules, self.tp_link = cfg.tp, {}, (0.0, 1.0)
        #: under ep > 1, the ep group's link its all-to-alls are priced on (set by make_plan)
        self.ep_link = (0.0, 1.0)
        #: under cp > 1, the cp group's link (set by make_plan), and per size the trace with each
        #: attention's cost beyond the rank's positions added (`measure/context.py`)
        self.cp_link = (0.0, 1.0)
        self._attended: dict[tuple, TracedModel] = {}
        #: under a search over cp (`plan.cp`), the models of each other cp degree (`at_cp`)
        self._by_cp: dict[int, TracedModels] = {}
        #: per (size, tp > 1, ep): the model (one ep rank's experts) traced at one tp rank's shapes
        #: and what the rewrite placed
        self._local: dict[tuple[int, int, int], TracedModel] = {}
        self._rewrites: dict[tuple[int, int, int], Rewritten] = {}
        self._sequence: dict[tuple[int, int, int], SequenceRewrite | None] = {}
        self._twins: dict[tuple[int, int, int], TracedModel] = {}
        self._priced: set[tuple[int, int, int]] = set()
        #: the (size, tp, ep) whose graphs carry their profile (or need none)
        self._profiled: set[tuple[int, int, int]] = set()

    def get(self, micro_batch_size: int, tp: int | None = None, ep: int | None = None,
            ep_link: tuple[float, float] | None = None, cp: int | None = None,
            cp_link: tuple[float, float] | None = None) -> TracedModel:
        """The model traced (and profiled, if asked) at this micro-batch size; under tp > 1 (the
        configured tp unless given) one tp rank's share of it (`measure/tensor_parallel.py`); under
        ep > 1 (the configured ep unless given) with one ep rank's experts and each MoE layer's
        all-to-alls priced on `ep_link` (latency, bandwidth; default `self.ep_link`): one trace and
        profile per (size, ep), a copy of it per link. Under cp > 1 (the configured cp unless
        given) one cp rank's positions (the model built at that cp: `at_cp`) with each attention's
        cost beyond them added, its exchanges on `cp_link` (default `self.cp_link`)."""
        if cp is not None and cp != self.cfg.cp:
            return self.at_cp(cp).get(micro_batch_size, tp, ep, ep_link, cp_link=cp_link)
        traced = self._get(micro_batch_size, tp, ep, ep_link)
        if self.cfg.cp == 1:
            return traced
        link = tuple(self.cp_link if cp_link is None else cp_link)
        key = (id(traced), link)
        if key not in self._attended:
            self._attended[key] = attended = replace(traced, graph=traced.graph.copy())
            dtype = PRECISIONS[str(self.cfg.precision)]
            add_context_costs(attended, self.cfg.cp, self.cfg.cp_method, link,
                              dtype.itemsize if dtype is not None else 4.0)
        return self._attended[key]

    def at_cp(self, cp: int | None) -> TracedModels:
        """The models of a cp degree the search tries (`plan.cp`): this one at the configured cp,
        else the model option built again at `context_parallel=cp` (model=gpt traces 1/cp of the
        positions) with the same links and tp plan, made once."""
        if cp is None or cp == self.cfg.cp:
            return self
        if cp not in self._by_cp:
            plugin = self.model_plugin.with_settings(self.model_plugin.option, context_parallel=cp)
            cfg = replace(self.cfg, cp=cp, model={**dict(self.cfg.model), "context_parallel": cp})
            other = TracedModels(plugin.build(), plugin, cfg, self.profile, self.cuda, self.device, self.hardware)
            other.tp_modules, other.tp_link, other.ep_link, other.cp_link = (self.tp_modules, self.tp_link,
                                                                             self.ep_link, self.cp_link)
            self._by_cp[cp] = other
        return self._by_cp[cp]

    def _get(self, micro_batch_size: int, tp: int | None, ep: int | None,
             ep_link: tuple[float, float] | None) -> TracedModel:
        tp, ep = tp or self.tp, ep or self.cfg.ep
        self.prepare([micro_batch_size], tp, ep)
        if tp == 1:
            traced = self._traced[(micro_batch_size, ep)]
        else:
            key = (micro_batch_size, tp, ep)
            traced = self._local_trace(*key)
            if key not in self._priced:
                dtypes = cached_autocast_dtypes(traced, self.spec.meta_args(micro_batch_size), self.cuda,
                                                PRECISIONS[str(self.cfg.precision)], micro_batch_size)
                add_collectives(traced, self._rewrites[key], tp, self.tp_link, self._sequence[key], dtypes)
                self._priced.add(key)
        if ep == 1:
            return traced
        # the experts' layers are whole on every tp rank (runtime/experts.py): the same all-to-alls
        link = tuple(self.ep_link if ep_link is None else ep_link)
        key = (micro_batch_size, tp, ep, link)
        if key not in self._exchanged:
            self._exchanged[key] = exchanged = replace(traced, graph=traced.graph.copy())
            combine, dispatch = self._exchange_bytes()
            add_all_to_alls(exchanged, ep, link, combine)
            _dispatched_at(exchanged, ep, link, dispatch / combine)
            exchanged.graph.graph["ep_link"] = link
        return self._exchanged[key]

    def _exchange_bytes(self) -> tuple[float, float]:
        """(combine, dispatch) bytes an all-to-all moves per byte of a MoE node's traced output.
        The traced output is fp32, or under a hardware file already in the dtype the run computes
        in (`analytic_profile`). Under mixed precision a layer combines its experts' outputs in
        that dtype and dispatches its norm's output, which autocast computes in fp32 (the runtime
        sends the rows as the layer gets them: runtime/experts.py)."""
        dtype = PRECISIONS[str(self.cfg.precision)]
        if dtype is None:
            return 1.0, 1.0
        traced_size = dtype.itemsize if self.hardware is not None else 4
        return dtype.itemsize / traced_size, 4 / traced_size

    def made(self, micro_batch_size: int, tp: int, tp_modules: Mapping[str, str] | None = None) -> TracedModel | None:
        """The trace already made at this size and tp (under tp > 1 with `tp_modules` split, the
        ones this plans), or None: never traces. For a later check of the plan that would trace
        the very same model again (the launcher's tp check: an 80-layer export is ~10 s)."""
        if tp == 1:
            return self._traced.get((micro_batch_size, self.cfg.ep))
        if tp_modules is not None and dict(tp_modules) != dict(self.tp_modules):
            return None
        return self._local.get((micro_batch_size, tp, self.cfg.ep))

    def structure(self, micro_batch_size: int, tp: int | None = None, ep: int | None = None,
                  cp: int | None = None) -> TracedModel:
        """The model traced at this size, profiled or not yet: for what reads only the graph's shape."""
        if cp is not None and cp != self.cfg.cp:
            return self.at_cp(cp).structure(micro_batch_size, tp, ep)
        tp, ep = tp or self.tp, ep or self.cfg.ep
        return self._whole(micro_batch_size, ep) if tp == 1 else self._local_trace(micro_batch_size, tp, ep)

    def _whole(self, micro_batch_size: int, ep: int) -> TracedModel:
        """The whole model (one ep rank's experts) traced at this size (what the profile measures)."""
        if (micro_batch_size, ep) not in self._traced:
            self._traced[(micro_batch_size, ep)] = self._trace(micro_batch_size, ep)
        return self._traced[(micro_batch_size, ep)]

    def _local_trace(self, micro_batch_size: int, tp: int, ep: int = 1) -> TracedModel:
        """The model (one ep rank's experts) traced with its split parameters at one tp rank's
        shapes (the ranks' own trace)."""
        key = (micro_batch_size, tp, ep)
        if key not in self._local:
            local, sharded = trace_local(ep_local(self.spec.build_meta(), ep),
                                         lambda m: self.spec.trace(micro_batch_size, m, repeat=True), self.tp_modules, tp)
            self._local[key] = local
            setup = sequence_setup(self.cfg.sequence_parallel, self.spec, micro_batch_size, tp)
            twin, self._rewrites[key], self._sequence[key] = profiled_twin(local, self.tp_modules, sharded, setup)
            self._twins[key] = twin  # what the profile runs, built once (a 1T GPT's took 3.6 s)
            seq = self._sequence[key]
            if seq is None:  # whole and equal on every tp rank (sent 1/tp over a boundary), or a slice
                same = replicated_values(twin.gm, sharded)
                layouts = {n: (REPLICATED if v else SPLIT, None) for n, v in same.items()}
            else:  # whole, this rank's positions, or a slice
                layouts = dict(seq.layouts)
            # what a stage boundary at a node carries: a row-parallel projection's g (and its bias)
            carried = {**self._rewrites[key].carried, **(seq.carried if seq is not None else {})}
            local.graph.graph["tp_layouts"] = {n: layouts[_follow(carried, n)] for n in layouts}
        return self._local[key]

    def prepare(self, sizes: Iterable[int], tp: int | None = None, ep: int | None = None,
                cp: int | None = None) -> None:
        """Trace, and profile if asked, every size of `sizes` (at `tp`, `ep` and `cp`, default the
        configured) not done yet; on this process's device the sizes are measured in shared passes
        (`profile_graphs`: the machine's drift between profiles taken one after another made a size
        look cheaper than another)."""
        if cp is not None and cp != self.cfg.cp:
            self.at_cp(cp).prepare(sizes, tp, ep)
            return
        tp, ep = tp or self.tp, ep or self.cfg.ep
        todo = {size: self.structure(size, tp, ep) for size in dict.fromkeys(sizes)
                if (size, tp, ep) not in self._profiled}
        modules = self.tp_modules if tp > 1 else {}
        if self.profile and todo:
            if self.hardware is not None:  # priced, not measured: nothing runs on a device
                twins = [(self._twins[(size, tp, ep)], self._rewrites[(size, tp, ep)]) for size in todo] if tp > 1 \
                    else None
                profile_traced(self.spec, self.cfg, list(todo.values()), list(todo), torch.device("meta"), modules,
                               tp, hardware=self.hardware, twins=twins, ep=ep)
            elif self.device is None:  # a GPU run planned in the launcher: a child per size
                for size, t in todo.items():
                    nodes, cached = profile_in_child(self.cfg, self.model_plugin, size, torch.device("cuda", 0),
                                                     modules, tp, ep)
                    apply_profile(t.graph, nodes)
                    t.graph.graph["profile_cached"] = cached
            else:
                if self.device.type == "cpu":  # what it would hold, refused before it is allocated
                    check_host_memory(list(todo.values()), list(todo), tp=tp)
                profile_traced(self.spec, self.cfg, list(todo.values()), list(todo), self.device, modules, tp, ep=ep)
        self._profiled.update((size, tp, ep) for size in todo)

    def _trace(self, micro_batch_size: int, ep: int) -> TracedModel:
        try:
            if ep not in self._models:  # under ep > 1 one ep rank's experts (measure/experts.py)
                self._models[ep] = ep_local(self.spec.build_meta(), ep)
            if self.model is None or ep == self.cfg.ep:  # the configured ep's: what the launcher checks
                self.model = self._models[ep]
            return self.spec.trace(micro_batch_size, self._models[ep], repeat=True)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - a model that cannot be built from these values
            raise ConfigError("model", f"model={self.spec.name} could not be built and traced with these "
                                       f"options: {type(err).__name__}: {err}") from err


def _dispatched_at(traced: TracedModel, ep: int, link: tuple[float, float], factor: float) -> None:
    """Each MoE node's dispatch rows (`ep_collectives`, priced by `add_all_to_alls` at the combine's
    bytes) at `factor` times those bytes, the difference added to the node's times as the
    exchanges were (`all_to_all_s`: the same messages, more bytes each)."""
    if factor == 1.0:
        return
    g = traced.graph
    profiled = all("forward_s" in g.nodes[n] for n in g.nodes)
    for name in g.nodes:
        node = g.nodes[name]
        if "ep_collectives" not in node:
            continue
        extra = sum(b * (factor - 1.0) for kind, b in node["ep_collectives"] if kind == "dispatch")
        node["ep_collectives"] = [(kind, b * factor if kind == "dispatch" else b) for kind, b in node["ep_collectives"]]
        seconds = (ep - 1) * extra / ep / link[1]
        for key in ("forward_s", "backward_s", "backward_input_s"):
            if profiled and key in node:
                node[key] += seconds


def _follow(carried: Mapping[str, str], name: str) -> str:
    while name in carried:
        name = carried[name]
    return name


def profile_traced(spec: ModelSpec, cfg: TrainConfig, traced: Sequence[TracedModel], micro_batch_sizes: Sequence[int],
                   device: torch.device, tp_modules: Mapping[str, str] | None = None, tp: int = 1,
                   hardware: Hardware | None = None,
                   twins: Sequence[tuple[TracedModel, Rewritten]] | None = None, ep: int | None = None) -> None:
    """Measure each of `traced` (one per micro-batch size) on one real micro-batch on `device`
    (cached on disk), in shared passes. A model that computes its own loss has it among its nodes
    (and the targets among its inputs): nothing to add. Under tp > 1 (`tp_modules`), `traced` are
    the model at one tp rank's shapes, run with shape-only collectives and, where the head's
    logits are split, the vocabulary-parallel loss's local work (`measure/tensor_parallel.py`).
    With `hardware`, priced on its figures instead (`analytic_profile.py`), in the dtype the run
    computes in. `twins`: under tp, each size's twin and rewrite when already built. `ep`: the
    expert-parallel degree `traced` hold one rank's experts of (default the configured)."""
    if hardware is not None:
        key: dict = {}
        timed_as_ranks: contextlib.AbstractContextManager = contextlib.nullcontext()
    elif device.type == "cuda":
        # what CPU profiles add to the key (threads, malloc) does not change a GPU's timings;
        # the GPU's name does (profile_key)
        key = {"model": cfg.model}
        timed_as_ranks = contextlib.nullcontext()
    else:
        # Timed as the ranks will run: their thread count, and their malloc (with glibc's defaults an
        # 8 MiB logits buffer is mapped afresh on some repeats and not on others: the head measured
        # 1.22-1.49x a block, 1.25-1.27x with freed memory kept).
        threads = cpu_threads(cfg.threads, cfg.world_size)
        key = {"model": cfg.model, "threads": threads, "host_allocator": str(cfg.host_allocator)}
        configure_host_allocator(key["host_allocator"])
        timed_as_ranks = profiling_threads(threads)
    ep = cfg.ep if ep is None else ep
    if ep > 1:  # one ep rank's experts: other shapes than ep=1's
        key = {**key, "ep": ep}
    jobs = []
    for i, (t, size) in enumerate(zip(traced, micro_batch_sizes, strict=True)):
        x, y = spec.example_batch(size, cfg.seed)
        loss_fn = spec.loss_fn
        if tp_modules and tp > 1:
            key = {**key, "tp": tp, "tp_modules": dict(tp_modules)}
            if cfg.sequence_parallel:
                key = {**key, "sequence_parallel": True}
            if twins is not None:
                t, done = twins[i]
            else:
                setup = sequence_setup(cfg.sequence_parallel, spec, size, tp)
                t, done, _ = profiled_twin(t, tp_modules, sharded_params(t.gm, tp_modules), setup)
            loss_fn = vocab_parallel_loss(0) if done.vocab_outputs else loss_fn
        jobs.append(ProfileJob(t, spec.model_args(x, y), key, None if spec.own_loss else (loss_fn, y)))
    if hardware is not None:
        price_graphs(jobs, hardware, PRECISIONS[str(cfg.precision)])
        return
    with timed_as_ranks:
        profile_graphs(jobs, device=device, seed=cfg.seed)


def profile_in_child(cfg: TrainConfig, model: Plugin, micro_batch_size: int, device: torch.device,
                     tp_modules: Mapping[str, str] | None = None, tp: int = 1,
                     ep: int | None = None) -> tuple[dict[str, dict], bool]:
    """Profile the model of `cfg` on `device` in a fresh process that exits before this returns,
    taking its CUDA context with it; returns every node's profile fields and whether the on-disk
    cache had them."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_profile_child, cfg, model, micro_batch_size, str(device), dict(tp_modules or {}),
                           tp, cfg.ep if ep is None else ep).result()


def _profile_child(cfg: TrainConfig, model: Plugin, micro_batch_size: int, device: str,
                   tp_modules: dict[str, str], tp: int, ep: int = 1) -> tuple[dict[str, dict], bool]:
    """The child's side: rebuild and retrace the model (deterministic: the same node names; under
    tp at one tp rank's shapes), then profile it on its GPU."""
    spec = model.build()
    meta = ep_local(spec.build_meta(), ep)
    if tp_modules and tp > 1:
        shard_meta(meta, tp_modules, tp)
    traced = spec.trace(micro_batch_size, meta, repeat=True)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    profile_traced(spec, cfg, [traced], [micro_batch_size], torch.device(device), tp_modules, tp, ep=ep)
    return profiled_nodes(traced.graph), bool(traced.graph.graph.get("profile_cached"))


def micro_batch_size(cfg: TrainConfig, microbatches: int, dp: int | None = None) -> int:
    """Sequences per micro-batch when each replica's share of the batch is cut into `microbatches`;
    `dp`: the replicas of the layout planned (a `plan.devices` candidate's), None: the configured dp."""
    return cfg.batch_size // ((cfg.dp if dp is None else dp) * microbatches)
