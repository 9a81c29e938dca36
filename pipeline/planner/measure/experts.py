"""One ep rank's work, and its all-to-alls priced: what the planner prices under ep > 1.

The model is traced with each mixture-of-experts layer holding one ep rank's `experts / ep`
routed experts (`ep_local`), so every parameter byte the partitioners, the memory model and the
replicas' collectives count is the rank's own. Which expert a token picks is a value the trace
cannot know: a rank's experts are priced as a balanced load, every token's `top_k` picks spread
evenly (`Experts.balanced`: the rank computes as many rows as it routes, its peers' tokens for its
experts in place of its own for theirs).

The exchanges are priced apart and added to the MoE layer's node: per micro-batch a dispatch and
a combine forward and the same two backward (in the input-gradient half under a split backward:
the weights' half needs none), each an all-to-all of the layer's routed rows (tokens x top_k x
hidden, in the dtype the layer computes in) of which a rank keeps 1/ep and sends the rest,
pairwise over the ep group's link (`all_to_all_s`). They run on the compute stream, in line, as
the runtime issues them (runtime/experts.py), so they add to the node's time.
"""

from __future__ import annotations

import torch
from torch import nn

from pipelaunch.models.hf_moe import HFExperts
from pipelaunch.models.moe import Experts, MoE
from pipelaunch.pipeline.graph.trace import TracedModel


def _balanced(experts: Experts, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A planning dispatch (a profile's real pass): this rank's experts computing as many rows as
    it routes, dealt out evenly, by the code the runtime runs on the rows it receives."""
    even = torch.arange(rows.shape[0], device=rows.device) % experts.local
    return experts.compute(rows, even)


def ep_local(model: nn.Module, ep: int) -> nn.Module:
    """`model` with each routed-experts module cut to one ep rank's experts (its parameters, on
    whatever device they are, sliced along the expert dimension), routed evenly over them."""
    if ep <= 1:
        return model
    for module in model.modules():
        if isinstance(module, (Experts, HFExperts)) and module.local == module.total:
            module.keep(0, module.total // ep)
            module.dispatch = _balanced
    return model


def all_to_all_s(nbytes: float, ep: int, latency_s: float, bandwidth: float) -> float:
    """An all-to-all of `nbytes` a rank holds over ep ranks, pairwise: ep - 1 sends of 1/ep each."""
    if ep < 2 or nbytes <= 0:
        return 0.0
    return (ep - 1) * (latency_s + nbytes / ep / bandwidth)


def moe_nodes(traced: TracedModel) -> dict[str, list[MoE | HFExperts]]:
    """The traced nodes that hold MoE layers (a leaf module of the trace that is one, or holds
    some: a transformer block; model=hf: the call of a transformers experts module), by node
    name, with the layers each holds."""
    found = {}
    for node in traced.gm.graph.nodes:
        if node.op == "call_module":
            module = traced.gm.get_submodule(str(node.target))
            layers = [m for m in module.modules() if isinstance(m, (MoE, HFExperts))]
            if layers:
                found[node.name] = layers
    return found


def expert_param_names(traced: TracedModel) -> set[str]:
    """The traced graph's parameter names (as its stages name them) of routed experts."""
    names = set()
    for prefix, module in traced.gm.named_modules():
        if isinstance(module, (Experts, HFExperts)):
            names |= {f"{prefix}.{n}" for n, _ in module.named_parameters()}
    return names


def add_all_to_alls(traced: TracedModel, ep: int, link: tuple[float, float], compute_bytes: float = 1.0) -> None:
    """Each MoE node's exchanges priced on `link` (latency, bandwidth) and added to its times (when
    profiled) and to its list `ep_collectives` (kind, bytes a rank holds); the token counts each
    layer's forward exchanges first (`ep_counts`, bytes; latency-bound: what sizes the dispatch)
    to its forward time alone. `compute_bytes`: the bytes of the dtype the layer computes in per
    fp32 byte (0.5 under bf16)."""
    g = traced.graph
    profiled = all("forward_s" in g.nodes[n] for n in g.nodes)
    for name, layers in moe_nodes(traced).items():
        node = g.nodes[name]
        # each layer maps the hidden state the node outputs (a block's, an hf experts call's):
        # its routed rows are top_k of the node's output rows
        nbytes = float(node["output_bytes"]) * compute_bytes
        node["ep_collectives"] = [(kind, nbytes * routed_share(m)) for m in layers for kind in ("dispatch", "combine")]
        node["ep_counts"] = [counts_bytes(m) for m in layers]
        if profiled:
            seconds = sum(all_to_all_s(b, ep, *link) for _, b in node["ep_collectives"])
            node["forward_s"] += seconds + sum(all_to_all_s(b, ep, *link) for b in node["ep_counts"])
            for key in ("backward_s", "backward_input_s"):
                if key in node:
                    node[key] += seconds
    g.graph["ep"] = ep
    g.graph["expert_params"] = sorted(expert_param_names(traced))


def counts_bytes(layer) -> float:  # noqa: ANN001 - a MoE layer of model=gpt's or transformers'
    """The bytes of the token counts a rank holds for one layer call's exchange: an int64 per
    (destination rank, its expert), every expert of the layer (runtime/experts.py `Dispatch`)."""
    return 8.0 * (layer.router.experts if isinstance(layer, MoE) else layer.total)


def exchange_s(node: dict, ep: int, link: tuple[float, float]) -> float:
    """A priced MoE node's all-to-alls in one micro-batch's forward and backward: dispatch and
    combine each way, the counts once (the backward reuses the forward's split sizes)."""
    return (2 * sum(all_to_all_s(b, ep, *link) for _, b in node.get("ep_collectives", ()))
            + sum(all_to_all_s(b, ep, *link) for b in node.get("ep_counts", ())))


def routed_share(layer) -> float:  # noqa: ANN001 - a MoE layer of model=gpt's or transformers'
    """Slots a balanced load sends per token: top_k, or under a capacity below an even share
    (model=gpt's moe.capacity_factor < 1) only those every expert keeps."""
    if isinstance(layer, MoE):
        return layer.router.top_k * min(1.0, layer.capacity_factor or 1.0)
    return float(layer.top_k)


def whole_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape in the whole model (what a checkpoint holds): an ep rank's experts
    at every expert's count."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for prefix, module in model.named_modules():
        if isinstance(module, (Experts, HFExperts)):
            shapes |= module.whole_shapes(prefix)
    return shapes
