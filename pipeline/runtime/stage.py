"""The stage modules a rank runs, built from the Plan: trace on meta, cut, materialise own stages.

Why retrace on the rank instead of shipping modules: tracing is deterministic, so every rank (and
the planner before it) derives the same graph from the model config; the Plan then only needs the
node -> stage assignment. Everything happens on the meta device until the rank materialises the
tensors of its own stages (`pipelaunch.pipeline.graph.materialize`), so a rank's parameter memory is its stages'
bytes, never the model's. This module is runtime: it imports no planner, partitioner or schedule.
"""

from __future__ import annotations

import torch
from torch import nn

from pipelaunch.models.spec import ModelSpec
from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.graph.materialize import materialize
from pipelaunch.pipeline.graph.recompute import recompute_blocks
from pipelaunch.pipeline.graph.split import split_model
from pipelaunch.pipeline.graph.tensor_parallel import Rewritten
from pipelaunch.pipeline.graph.trace import TracedModel, retarget
from pipelaunch.pipeline.graph.units import StageUnits, node_param_uses, stage_units
from pipelaunch.pipeline.runtime.tensor_parallel import TensorParallel, local_stages


class StageModule(nn.Module):
    """A stage cut out of a traced model: forward(**named values) -> dict of named values."""

    def __init__(self, index: int, gm: torch.fx.GraphModule, aliases: dict[str, str],
                 tensor_parallel: Rewritten | None = None, split_dims: dict[str, int] | None = None,
                 sequence_partial: list[str] | None = None) -> None:
        super().__init__()
        self.index = index
        self.gm = gm
        self.aliases = aliases
        #: under tp > 1, what the rewrite inserted and which outputs are vocabulary-split logits
        self.tensor_parallel = tensor_parallel
        #: under tp > 1, the parameters this rank holds a slice of -> the dimension split
        self.split_dims = split_dims or {}
        #: under sequence parallelism, the parameters (graph names) each tp rank computes a partial
        #: gradient of, from its positions: summed over the tp ranks once per step
        self.sequence_partial = sequence_partial or []
        #: under ep > 1, the parameters (full-model names) this rank holds its share of the experts of
        self.expert_params: set[str] = set()
        #: of those, the ones it holds whole (a list of experts' own: models/list_experts.py)
        self.whole_experts: set[str] = set()

    def forward(self, **values: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.gm(**values)

    def named_model_parameters(self):
        """Parameters under the full model's own (canonical) names: a tied alias maps to its owner."""
        for name, p in self.gm.named_parameters():
            yield self.aliases.get(name, name), p


def meta_tensor_names(module: nn.Module) -> set[str]:
    """Qualified names of a stage's tensors still on the meta device (what it must materialise;
    constants an export trace baked in are real already)."""
    return {n for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
            if t.device.type == "meta"}


def build_stage_modules(
    spec: ModelSpec, plan: Plan, pp_rank: int, seed: int, device: torch.device, traced: TracedModel | None = None,
    initial=None, tp: TensorParallel | None = None,
) -> dict[int, StageModule]:
    """This rank's stage modules with real tensors on `device`; the rest of the model stays on the
    meta device and is dropped. The tensors' values: read by name from `initial` (the constructor's
    own, `pipeline.graph.initial_weights.InitialWeights`), else initialised by name. Stages of one
    rank that share a parameter share the very same tensor. The leaf modules a stage lists in
    `recompute` run checkpointed. `traced`: a trace of this model at the plan's micro-batch size
    made earlier, used up here (the launcher's split check builds every rank's stages from copies
    of one: tracing is deterministic, and the stages' tensors come by name from the model
    materialised here, never from the trace). `tp`: this rank's tensor-parallel group (plan.tp >
    1): the stages are then its slices, rewritten with the tp collectives
    (`runtime/tensor_parallel.py`)."""
    model = spec.build_meta()
    traced = spec.trace(plan.micro_batch_size, model) if traced is None else traced
    retarget(traced.gm, device)
    split = split_model(traced, plan.assignment, len(plan.stages))
    own = {s.index: split.stages[s.index] for s in plan.stages_of(pp_rank)}
    names = set().union(*(meta_tensor_names(gm) for gm in own.values()))
    materialize(model, seed, device, spec.init, names={traced.param_aliases.get(n, n) for n in names},
                also=own.values(), load=spec.load, initial=initial, whole_init=spec.init_weights)
    for gm in own.values():
        _constants_to(gm, device)
    rewrites, dims, partial = {}, {}, {}
    if tp is not None and plan.tp > 1:
        local = local_stages(spec, plan, own, tp, device)
        own, rewrites, dims, partial = local.stages, local.rewrites, local.dims, local.partial
    for i, gm in own.items():
        recompute_blocks(gm, plan.stages[i].recompute, plan.stages[i].selective)
    return {i: StageModule(i, gm, dict(split.param_aliases), rewrites.get(i), dims, partial.get(i))
            for i, gm in own.items()}


def _constants_to(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Tensors an export trace keeps as plain attributes (lifted constants) go where the stage runs."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        value = getattr(owner, attr)
        if (isinstance(value, torch.Tensor) and attr not in owner._parameters and attr not in owner._buffers
                and value.device != device):
            setattr(owner, attr, value.to(device))


def module_units(module: StageModule, plan: Plan) -> StageUnits:
    """The stage's units (pipeline/graph/units.py) on its own graph: what the data-parallel
    collectives gather, release and reduce together; tied parameters (`plan.shared_params`) in none."""
    sizes = {n: float(p.numel() * p.element_size()) for n, p in module.gm.named_parameters(remove_duplicate=False)}
    return stage_units(node_param_uses(module.gm), sizes, excluded=plan.shared_params, canonical=module.aliases,
                       bucket_bytes=plan.meta.bucket_bytes)
