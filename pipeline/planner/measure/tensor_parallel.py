"""One tp rank's work, measured, and its collectives priced: what the planner prices under tp > 1.

The model is traced at one tp rank's shapes (its planned parameters sliced: the ranks' own trace),
and that trace is what the profile measures, node by node, with the rewrite's collectives stood in
by shape-only modules (`SHAPE_ONLY`: the vocabulary-split lookup clamps its ids instead of
summing over ranks) and the loss by the vocabulary-parallel cross-entropy's local work. So a
node's time is the rank's own: a projection on its slice, attention over its heads, a norm on the
whole hidden state, the loss's masked gathers, as the rank runs them.

The collectives the rewrite places are priced apart, as ring all-reduces on the tp link, and added
to the node they belong to: `g` and the lookup's to its forward, `f` to its backward (the
input-gradient half under a split backward: the weight-gradient half needs none), the loss's
three to the head's forward. Megatron runs them on the compute stream, so they add to the node's
time rather than overlap it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace

import networkx as nx

from pipelaunch.pipeline.graph.tensor_parallel import SHAPE_ONLY, Rewritten, Sharded, parallelize
from pipelaunch.pipeline.graph.trace import TracedModel

#: the vocabulary-parallel loss's all-reduces per micro-batch (max, sum of exponentials, target logit)
LOSS_ALL_REDUCES = 3


def all_reduce_s(nbytes: float, tp: int, latency_s: float, bandwidth: float) -> float:
    """A ring all-reduce over tp ranks: 2 (tp - 1) steps, each sending 1/tp of the bytes."""
    return 2 * (tp - 1) * (latency_s + nbytes / tp / bandwidth)


def all_gather_s(nbytes: float, tp: int, latency_s: float, bandwidth: float) -> float:
    """A ring all-gather of `nbytes` in all over tp ranks: tp - 1 steps of 1/tp of the bytes."""
    return (tp - 1) * (latency_s + nbytes / tp / bandwidth)


def profiled_twin(local: TracedModel, modules: Mapping[str, str], sharded: Mapping[str, Sharded]
                  ) -> tuple[TracedModel, Rewritten]:
    """What the profile runs for `local`: a copy of its graph rewritten with shape-only collectives,
    annotating `local`'s own cost graph; and what the rewrite placed."""
    gm = copy.deepcopy(local.gm)
    done = parallelize(gm, sharded, modules, SHAPE_ONLY)
    return replace(local, gm=gm), done


def add_collectives(local: TracedModel, done: Rewritten, tp: int, link: tuple[float, float]) -> None:
    """Each tp collective `done` placed, priced on `link` (latency, bandwidth) and added to its
    node's times (when profiled) and to its list `tp_collectives` (kind, bytes)."""
    g = local.graph
    profiled = all("forward_s" in g.nodes[n] for n in g.nodes)
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
        shape = (node.get("shape") or [[1]])[0]  # [dims, dtype]
        # one fp32 value per position: the logits' bytes over the rank's vocabulary
        per_position = node["output_bytes"] / max(1, shape[-1] if shape else 1)
        node.setdefault("tp_collectives", []).extend([("loss", per_position)] * LOSS_ALL_REDUCES)
        if profiled:
            node["forward_s"] += LOSS_ALL_REDUCES * all_reduce_s(per_position, tp, *link)
    g.graph["tp"] = tp
    g.graph["tp_link"] = tuple(link)  # what a stage boundary's all-gather is priced on (planner/build.py)


def _input_bytes(g: nx.DiGraph, name: str) -> float:
    """What an `f` all-reduces in the backward: the gradient of the node's largest input."""
    sizes = [g.edges[u, name]["bytes"] for u in g.predecessors(name)]
    return max(sizes, default=g.nodes[name]["output_bytes"])
