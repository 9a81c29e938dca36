"""Values computed from the model's inputs alone: rebuilt on every stage that reads them, never sent.

Why: a model builds some tensors once, above its layers, from nothing but its inputs, its buffers
and constants: transformers' causal and packed-document masks, the rotary cos/sin tables (from
the position ids and the `inv_freq` buffer), position ids from `arange`, ALiBi slopes. Cut into
stages, each of them becomes a boundary value that stage 0 sends to every later stage reading it,
and each receiver holds it per micro-batch in flight: at seq 4096 over 80 stages, gigabytes on the
network and in memory. Every rank already has the inputs (the data is drawn on every rank), so a
stage reading such a value computes it again from them, as Megatron and torchtitan build the
rotary tables and masks on each stage. Its cost is the nodes' own forward (a few elementwise ops),
priced on the stage that rebuilds them.

The rule, one for the planner and the rank (both cut through `split.split_model`): a compute node
is *derived* when every value it reads is a model input, a buffer or a constant (never a
parameter), or another derived node; it draws no random numbers; a module it calls holds no
parameters; and nothing later writes into its output in place. A stage reading a derived node of
another stage runs that node and its derived ancestors itself (`rebuilt_nodes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import fx, nn

#: the fx node kinds that compute (trace.COMPUTE_OPS, repeated here: trace imports this module)
_COMPUTE = ("call_module", "call_function", "call_method")

#: Python-level callables (torch.fx call_function targets) that draw random numbers
_RANDOM_FUNCTIONS = {
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.randperm,
    nn.functional.dropout, nn.functional.dropout1d, nn.functional.dropout2d, nn.functional.dropout3d,
    nn.functional.alpha_dropout, nn.functional.feature_alpha_dropout, nn.functional.gumbel_softmax,
    nn.functional.rrelu,
}
#: tensor methods (call_method targets) that draw random numbers
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
                   "cauchy_", "log_normal_", "multinomial"}


def _draws_random(node: fx.Node, gm: fx.GraphModule) -> bool:
    target = node.target
    if node.op == "call_function":
        if isinstance(target, torch._ops.OpOverload):
            return torch.Tag.nondeterministic_seeded in target.tags
        return target in _RANDOM_FUNCTIONS
    if node.op == "call_method":
        return target in _RANDOM_METHODS
    module = gm.get_submodule(target)
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


def _is_parameter(gm: fx.GraphModule, target: str) -> bool:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return isinstance(obj, nn.Parameter)


def _written_in_place(node: fx.Node) -> bool:
    """Whether a later node mutates `node`'s output (a method or function ending in `_` taking it
    first): a rebuilt copy would miss what was written into it."""
    for user in node.users:
        name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
        if isinstance(user.target, torch._ops.OpOverload):
            name = user.target.overloadpacket.__name__
        if name.endswith("_") and not name.endswith("__") and user.args and user.args[0] is node:
            return True
    return False


def derived_nodes(gm: fx.GraphModule) -> set[str]:
    """Names of the compute nodes of `gm` whose value depends only on its inputs, buffers and
    constants (the module docstring's rule)."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        if node.op == "call_module" and next(gm.get_submodule(node.target).parameters(), None) is not None:
            continue
        if _draws_random(node, gm) or _written_in_place(node):
            continue
        if all(i.op == "placeholder" or (i.op == "get_attr" and not _is_parameter(gm, i.target)) or i.name in out
               for i in node.all_input_nodes):
            out.add(node.name)
    return out


def _ancestors(node: fx.Node, derived: set[str], into: set[str]) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        if n.name in into:
            continue
        into.add(n.name)
        stack.extend(i for i in n.all_input_nodes if i.name in derived)


def rebuilt_nodes(gm: fx.GraphModule, assignment: Mapping[str, int], num_stages: int,
                  derived: set[str] | None = None) -> list[list[str]]:
    """Per stage, the derived nodes of other stages it computes itself, in program order: every
    derived value it reads from another stage, with the derived nodes that value is made from."""
    derived = derived_nodes(gm) if derived is None else derived
    need: list[set[str]] = [set() for _ in range(num_stages)]
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        s = assignment[node.name]
        for i in node.all_input_nodes:
            if i.name in derived and assignment[i.name] != s:
                _ancestors(i, derived, need[s])
    order = [n.name for n in gm.graph.nodes]
    return [[n for n in order if n in need[s] and assignment[n] != s] for s in range(num_stages)]


def sent_bytes(data: Mapping) -> int:
    """What sending a cost-graph node's output to another stage costs in bytes: 0 for a derived
    value (`derived` on the node: every stage reading it rebuilds it), else its `output_bytes`."""
    return 0 if data.get("derived") else int(data.get("output_bytes", 0) or 0)


def rebuilt_forward_s(graph, rebuilt: Sequence[Sequence[str]]) -> list[float]:
    """Per stage, the profiled forward seconds of the derived nodes it rebuilds (`graph`: the cost
    graph, a networkx DiGraph)."""
    return [float(sum(graph.nodes[n].get("forward_s", 0.0) for n in names if n in graph)) for names in rebuilt]
