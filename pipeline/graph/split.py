"""Cut a traced model into one fx GraphModule per stage, plus the dataflow between stages.

Why explicit named values: with skip connections a value can travel from stage 0 straight to stage 3,
and a stage can take and return any number of tensors. Each stage therefore takes keyword arguments
named after the fx values it reads and returns a dict of the values other stages (or the model
output) need, and `SplitModel.io` says who produces and who consumes each of them. The executor only
has to route names.

Parameters stay under their full-model qualified names (fx copies referenced submodules and
attributes by path), so `pipelaunch.pipeline.graph.init.init_by_name` and state-dict comparisons line up. A parameter
read by several stages (tied weights) is copied into each and listed in `shared_params`; whoever runs
the stages must sum its gradients across those stages (and keep the copies equal).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils import _pytree as pytree

from pipelaunch.pipeline.graph.assignment import validate_assignment
from pipelaunch.pipeline.graph.derived import rebuilt_nodes
from pipelaunch.pipeline.graph.trace import COMPUTE_OPS, TracedModel


@dataclass
class StageIO:
    """What one stage reads and writes.

    `inputs[value]` is the producing stage, or None for a model input; `outputs[value]` lists the
    later stages that read it (empty when it is only a model output).
    """

    index: int
    inputs: dict[str, int | None]
    outputs: dict[str, list[int]]
    params: list[str]  # qualified names inside this stage's module (aliases of tied params included)
    #: nodes of other stages this one computes again from the model inputs (graph/derived.py)
    rebuilt: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ValueRef:
    """A placeholder for a named value inside `SplitModel.output_structure`."""

    name: str


@dataclass
class SplitModel:
    """Stage modules and the description needed to run them in any process layout."""

    stages: list[fx.GraphModule]
    io: list[StageIO]
    input_names: list[str]
    model_outputs: dict[str, int | None]  # value -> producing stage (None: a model input passed through)
    output_structure: Any
    shared_params: dict[str, list[int]]
    param_aliases: dict[str, str] = field(default_factory=dict)
    out_spec: Any = None

    def canonical(self, name: str) -> str:
        """The full model's own name for a (possibly aliased, i.e. tied) parameter name."""
        return self.param_aliases.get(name, name)

    def describe(self) -> dict[str, Any]:
        """A JSON-serialisable view of the dataflow, for plan.json and for humans."""
        return {
            "inputs": list(self.input_names),
            "model_outputs": dict(self.model_outputs),
            "shared_params": {k: list(v) for k, v in self.shared_params.items()},
            "stages": [
                {
                    "index": io.index,
                    "inputs": dict(io.inputs),
                    "outputs": dict(io.outputs),
                    "params": list(io.params),
                }
                for io in self.io
            ],
        }


def _structure(arg: Any) -> Any:
    return fx.node.map_arg(arg, lambda n: ValueRef(n.name))


def rebuild_outputs(structure: Any, env: Mapping[str, Any]) -> Any:
    if isinstance(structure, ValueRef):
        return env[structure.name]
    if isinstance(structure, tuple):
        return tuple(rebuild_outputs(s, env) for s in structure)
    if isinstance(structure, list):
        return [rebuild_outputs(s, env) for s in structure]
    if isinstance(structure, dict):
        return {k: rebuild_outputs(v, env) for k, v in structure.items()}
    return structure


def split_model(
    traced: TracedModel, assignment: Mapping[str, int], num_stages: int | None = None, *, lazy: bool = False
) -> SplitModel:
    """Build the stage GraphModules for a node -> stage assignment over `traced.graph`'s nodes.
    A value computed from the inputs alone (`graph.derived`: masks, rotary tables, position ids)
    is rebuilt by each stage reading it, from the model inputs, instead of crossing a boundary
    (`StageIO.rebuilt`). `lazy`: each stage's Python code is generated when first run or read, not
    now (the planner reads only the stages' graphs and parameters: an 80-layer op-level graph's
    code took ~0.5 s to generate and compile, for every candidate built)."""
    make = _LazyGraphModule if lazy else fx.GraphModule
    k = num_stages if num_stages is not None else max(assignment.values()) + 1
    validate_assignment(traced.graph, assignment, k)
    gm = traced.gm
    nodes = list(gm.graph.nodes)
    out_node = next(n for n in nodes if n.op == "output")
    rebuilt = rebuilt_nodes(gm, assignment, k)
    runs: list[set[str]] = [set(names) for names in rebuilt]  # the nodes each stage computes
    for name, s in assignment.items():
        runs[s].add(name)
    inputs, outputs = _dataflow(nodes, assignment, rebuilt, runs)
    model_outputs: dict[str, int | None] = {}
    for i in out_node.all_input_nodes:
        if i.op == "get_attr":
            raise NotImplementedError(f"model returns attribute {i.target!r} directly; wrap it in an op")
        src = None if i.op == "placeholder" else assignment[i.name]
        model_outputs[i.name] = src
        if src is not None:
            outputs[src].setdefault(i.name, [])

    position = {n.name: idx for idx, n in enumerate(nodes)}
    stages: list[fx.GraphModule] = []
    ios: list[StageIO] = []
    for s in range(k):
        g = fx.Graph()
        env: dict[str, fx.Node] = {}
        for name in sorted(inputs[s], key=position.__getitem__):
            env[name] = g.placeholder(name)
        for n in nodes:
            if n.op not in COMPUTE_OPS or n.name not in runs[s]:
                continue
            for i in n.all_input_nodes:
                if i.op == "get_attr" and i.name not in env:
                    env[i.name] = g.node_copy(i)
            env[n.name] = g.node_copy(n, lambda x, env=env: env[x.name])
        g.output({name: env[name] for name in sorted(outputs[s], key=position.__getitem__)})
        stage = make(gm, g, f"Stage{s}")
        stages.append(stage)
        inputs[s] = {name: inputs[s][name] for name in sorted(inputs[s], key=position.__getitem__)}
        outputs[s] = {name: sorted(outputs[s][name]) for name in sorted(outputs[s], key=position.__getitem__)}
        names = [name for name, _ in stage.named_parameters(remove_duplicate=False)]
        ios.append(StageIO(s, inputs[s], outputs[s], names, rebuilt[s]))

    return SplitModel(
        stages=stages,
        io=ios,
        input_names=[n.name for n in nodes if n.op == "placeholder"],
        model_outputs=model_outputs,
        output_structure=_structure(out_node.args[0]),
        shared_params=_shared_params(traced, ios),
        param_aliases=dict(traced.param_aliases),
        out_spec=traced.out_spec,
    )


def _dataflow(nodes: Sequence[fx.Node], assignment: Mapping[str, int], rebuilt: Sequence[Sequence[str]],
              runs: Sequence[set[str]]) -> tuple[list[dict[str, int | None]], list[dict[str, list[int]]]]:
    """Per stage, the values it reads (producing stage, None for a model input) and those it
    makes for later stages (their consumers): every node a stage runs, its own and those it
    rebuilds, reads what it does not compute from the data or from the stage assigned it."""
    k = len(runs)
    stages_running: dict[str, list[int]] = {}
    for t, names in enumerate(rebuilt):
        for name in names:
            stages_running.setdefault(name, []).append(t)
    inputs: list[dict[str, int | None]] = [{} for _ in range(k)]
    outputs: list[dict[str, list[int]]] = [{} for _ in range(k)]
    for n in nodes:
        if n.op not in COMPUTE_OPS:
            continue
        for s in [assignment[n.name], *stages_running.get(n.name, ())]:
            for i in n.all_input_nodes:
                if i.op == "get_attr" or i.name in runs[s]:
                    continue
                if i.op == "placeholder":
                    inputs[s][i.name] = None
                    continue
                src = assignment[i.name]
                inputs[s][i.name] = src
                consumers = outputs[src].setdefault(i.name, [])
                if s not in consumers:
                    consumers.append(s)
    return inputs, outputs


def _shared_params(traced: TracedModel, ios: Sequence[StageIO]) -> dict[str, list[int]]:
    """Each parameter (by its canonical name) that more than one stage holds -> those stages."""
    holders: dict[str, set[int]] = {}
    for s, io in enumerate(ios):
        for name in io.params:
            holders.setdefault(traced.param_aliases.get(name, name), set()).add(s)
    return {p: sorted(st) for p, st in holders.items() if len(st) > 1}


def run_in_order(split: SplitModel, *args: Any, stages: Sequence[nn.Module] | None = None) -> Any:
    """Every stage run in order in this process, values routed by name; returns the model's output.
    What a pipeline computes, without one: the launcher's split check (`pipelaunch.launcher.split_check`)
    runs the ranks' stages this way against the unsplit module. `stages` may replace
    `split.stages` (each rank's own stage modules, or deep copies)."""
    mods = list(stages) if stages is not None else split.stages
    if len(args) != len(split.input_names):
        raise TypeError(f"model takes {len(split.input_names)} inputs {split.input_names}, got {len(args)}")
    env: dict[str, Any] = dict(zip(split.input_names, args, strict=True))
    for io, mod in zip(split.io, mods, strict=True):
        env.update(mod(**{name: env[name] for name in io.inputs}))
    result = rebuild_outputs(split.output_structure, env)
    if split.out_spec is not None:
        result = pytree.tree_unflatten(list(result), split.out_spec)
    return result
