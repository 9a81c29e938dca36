"""One tp rank's share of a profiled model: what the planner prices under tp > 1.

The profile measures the whole model's nodes (on this machine a rank's slice could not run alone:
its vocabulary-split lookup and loss read ids outside its rows). Each node of the model traced at
one tp rank's shapes then takes the measured node's times and activation bytes scaled by the share
of it a tp rank computes: its parameters' share (a projection split by tp: 1/tp; a norm kept
whole: 1), or, for a node without parameters, its output's (attention over a rank's heads: 1/tp).
Its parameters, outputs and the values crossing stage boundaries are the local trace's own. The
collectives the rewrite places (pipeline/graph/tensor_parallel.py) are priced as ring all-reduces
on the tp link and added to the node they belong to: `g` and the lookup's to its forward, `f` to
its backward (the input-gradient half under a split backward: the weight-gradient half needs
none), the vocabulary-parallel loss's three to the head's forward. Megatron runs them on the
compute stream, so they add to the node's time rather than overlap it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import networkx as nx

from pipelaunch.pipeline.graph.tensor_parallel import SHAPE_ONLY, Sharded, parallelize
from pipelaunch.pipeline.graph.trace import TracedModel

#: what a node's measured cost is scaled by (its parameters, outputs and edges are the local trace's)
SCALED = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "activation_bytes", "stash_bytes",
          "loss_activation_bytes")
#: the vocabulary-parallel loss's all-reduces per micro-batch (max, sum of exponentials, target logit)
LOSS_ALL_REDUCES = 3


def all_reduce_s(nbytes: float, tp: int, latency_s: float, bandwidth: float) -> float:
    """A ring all-reduce over tp ranks: 2 (tp - 1) steps, each sending 1/tp of the bytes."""
    return 2 * (tp - 1) * (latency_s + nbytes / tp / bandwidth)


def share(whole: Mapping, local: Mapping) -> float:
    """The part of a node's work one tp rank does: its parameters', else its output's share."""
    if whole.get("param_bytes"):
        return local["param_bytes"] / whole["param_bytes"]
    if whole.get("output_bytes"):
        return local["output_bytes"] / whole["output_bytes"]
    return 1.0


def localized(full: TracedModel, local: TracedModel, modules: Mapping[str, str], sharded: Mapping[str, Sharded],
              tp: int, link: tuple[float, float]) -> TracedModel:
    """`local` (the model traced at one tp rank's shapes) priced from `full`'s profile, with its
    tp collectives on `link` (latency, bandwidth); in place, returned. Unprofiled: shapes only."""
    g, measured = local.graph, full.graph
    profiled = all("forward_s" in measured.nodes[n] for n in measured.nodes)
    if profiled:
        for name in g.nodes:
            whole, node = measured.nodes[name], g.nodes[name]
            ratio = share(whole, node)
            node.update({k: whole[k] * ratio for k in SCALED if k in whole})
            node["tp_share"] = ratio
    done = parallelize(copy.deepcopy(local.gm), sharded, modules, SHAPE_ONLY)
    for inserted, kind in done.inserted.items():
        owner = done.at[inserted]
        node = g.nodes[owner]
        nbytes = _input_bytes(g, owner) if kind == "copy" else node["output_bytes"]
        node.setdefault("tp_collectives", []).append((kind, float(nbytes)))
        if profiled:
            seconds = all_reduce_s(nbytes, tp, *link)
            for key in (("backward_s", "backward_input_s") if kind == "copy" else ("forward_s",)):
                node[key] += seconds
    for owner in done.vocab_outputs:
        node = g.nodes[owner]
        # one fp32 value per position: the logits' bytes over the rank's vocabulary
        shape = (node.get("shape") or [[1]])[0]  # [dims, dtype]
        per_position = node["output_bytes"] / max(1, shape[-1] if shape else 1)
        node.setdefault("tp_collectives", []).extend([("loss", per_position)] * LOSS_ALL_REDUCES)
        if profiled:
            node["forward_s"] += LOSS_ALL_REDUCES * all_reduce_s(per_position, tp, *link)
    g.graph["tp"] = tp
    return local


def _input_bytes(g: nx.DiGraph, name: str) -> float:
    """What an `f` all-reduces in the backward: the gradient of the node's largest input."""
    sizes = [g.edges[u, name]["bytes"] for u in g.predecessors(name)]
    return max(sizes, default=g.nodes[name]["output_bytes"])
