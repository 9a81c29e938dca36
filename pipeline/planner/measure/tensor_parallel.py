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
from collections.abc import Callable, Mapping
from dataclasses import replace

import networkx as nx
import torch
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.passes.shape_prop import TensorMetadata

from pipelaunch.pipeline.graph.sequence_parallel import (
    REPLICATED,
    SequenceRewrite,
    SequenceSetup,
    sequence_parallel,
    shape_only,
)
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


def profiled_twin(local: TracedModel, modules: Mapping[str, str], sharded: Mapping[str, Sharded],
                  sequence: SequenceSetup | None = None) -> tuple[TracedModel, Rewritten, SequenceRewrite | None]:
    """What the profile runs for `local`: a copy of its graph rewritten with shape-only collectives
    (under sequence parallelism their shape changes too: the local work at the local shapes),
    annotating `local`'s own cost graph; and what the rewrites placed."""
    with _use_lazy_graph_module(True):  # its code made if it ever runs (an 80-layer copy: 0.7 s -> 0.35 s)
        gm = copy.deepcopy(local.gm)
    done = parallelize(gm, sharded, modules, SHAPE_ONLY)
    seq = None
    if sequence is not None:
        seq = sequence_parallel(gm, shape_only(sequence.tp), sequence.tp, sequence.seq_len, sharded,
                                [(a, (REPLICATED, None)) for a in sequence.args], keep=lambda name: False)
    return replace(local, gm=gm), done, seq


#: the sequence-parallel collectives' ring steps (each tp - 1 of 1/tp of the whole value's bytes),
#: as (where, how many): forward, backward
SEQUENCE_STEPS = {"scatter": (1, 1), "gather": (1, 1), "to_whole": (1, 0), "to_part": (0, 1), "partial": (0, 2)}


def add_collectives(local: TracedModel, done: Rewritten, tp: int, link: tuple[float, float],
                    seq: SequenceRewrite | None = None, dtypes: Mapping[str, torch.dtype] | None = None) -> None:
    """Each tp collective `done` placed (and under sequence parallelism `seq`'s), priced on `link`
    (latency, bandwidth) and added to its node's times (when profiled) and to its list
    `tp_collectives` (kind, bytes). `dtypes`: under bf16, each traced value's dtype as autocast
    gives it (`measure.autocast`): a collective moves a value in that dtype (a matmul's bf16
    output reduced, a norm's fp32 output gathered), not in the fp32 it was traced in."""
    g = local.graph
    scale = _dtype_scale(local, dtypes)
    compute = min((d.itemsize for d in (dtypes or {}).values() if d.is_floating_point), default=4) / 4
    profiled = all("forward_s" in g.nodes[n] for n in g.nodes)
    replaced = set(seq.replaced) if seq is not None else set()
    for inserted, kind in (seq.inserted.items() if seq is not None else ()):
        owner = _owner(g, seq.at[inserted], seq.at, done.at)
        if owner is None:
            continue
        node = g.nodes[owner]
        moved = seq.moves.get(inserted, owner)
        nbytes = float(seq.bytes.get(inserted, 0)) * (compute if inserted in seq.matmul and scale(moved) == 1.0
                                                      else scale(moved))
        node.setdefault("tp_collectives", []).append((kind, nbytes))
        forward, backward = SEQUENCE_STEPS[kind]
        if profiled:
            step = all_gather_s(nbytes, tp, *link)
            node["forward_s"] += forward * step
            for key in ("backward_s", "backward_input_s"):
                node[key] += backward * step
    for inserted, kind in done.inserted.items():
        if inserted in replaced:
            continue
        owner = done.at[inserted]
        node = g.nodes[owner]
        nbytes = _input_bytes(g, owner) * scale(_largest_input(g, owner)) if kind == "copy" \
            else node["output_bytes"] * scale(owner)
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


def _owner(g: nx.DiGraph, name: str, *inserted_at: Mapping[str, str]) -> str | None:
    """The traced node an inserted one's work belongs to (it may belong to another inserted one)."""
    for _ in range(8):
        if name in g:
            return name
        name = next((at[name] for at in inserted_at if name in at), None)
        if name is None:
            return None
    return None


def _dtype_scale(local: TracedModel, dtypes: Mapping[str, torch.dtype] | None) -> Callable[[str | None], float]:
    """Per traced node, its value's bytes under autocast over its bytes as traced (1 without)."""
    if not dtypes:
        return lambda name: 1.0
    traced = {n.name: n.meta["tensor_meta"].dtype for n in local.gm.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), TensorMetadata)}

    def scale(name: str | None) -> float:
        if name not in dtypes or name not in traced:
            return 1.0
        return dtypes[name].itemsize / traced[name].itemsize

    return scale


def _largest_input(g: nx.DiGraph, name: str) -> str | None:
    return max(g.predecessors(name), key=lambda u: g.edges[u, name]["bytes"], default=None)


def _input_bytes(g: nx.DiGraph, name: str) -> float:
    """What an `f` all-reduces in the backward: the gradient of the node's largest input."""
    sizes = [g.edges[u, name]["bytes"] for u in g.predecessors(name)]
    return max(sizes, default=g.nodes[name]["output_bytes"])
