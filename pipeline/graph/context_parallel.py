"""cp > 1 on a model written without cp in mind (`model=hf`, `model=module`): its traced graph's
attention and positions made to cross the cp group.

Why a rewrite of the graph and not of the model: the model's own code calls torch's
`scaled_dot_product_attention` and makes its tokens' positions with `arange` (transformers'
`cache_position`, a learned position table's index). The graph every rank cuts holds those calls
as nodes; two kinds are retargeted in place (same name, arguments and users), so the cost graph
the planner made from it stays true:

- each `scaled_dot_product_attention` becomes `compute.context_parallel.sdpa`: torch's own outside
  cp, over the cp group inside (the ring or the all-to-all, the rank's global positions);
- each `arange` of the rank's length from 0 in steps of 1 becomes `compute.context_parallel.arange`:
  the global positions of the tokens the rank holds, so rotary tables and position embeddings are
  those of its tokens.

What cannot be split is refused before any rank starts (a ConfigError naming the module): no
attention call in the graph (attention computed its own way, or inside a leaf module), a mask
handed to the attention (built over the rank's positions only), attention dropout, and a softmax
over a [.., t, t] tensor (scores materialised: `attn_implementation=eager`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from pipelaunch.pipeline.compute import context_parallel as cp_compute
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.trace import TracedModel, build_cost_graph, innermost_module

aten = torch.ops.aten
SDPA = {aten.scaled_dot_product_attention.default, torch.nn.functional.scaled_dot_product_attention}
ARANGE = {torch.arange, aten.arange.default, aten.arange.start, aten.arange.start_step}
SOFTMAX = {aten._softmax.default, aten.softmax.int, torch.softmax, torch.nn.functional.softmax}


def local_length(seq_len: int, cp: int) -> int:
    """The positions one cp rank traces and runs (1/cp of the sequence): 2 x cp chunks, a head and
    a tail per rank, so that causal attention costs each rank the same."""
    if seq_len % (2 * cp):
        fits = [c for c in range(1, seq_len // 2 + 1) if seq_len % (2 * c) == 0]
        raise ConfigError("cp", f"cp={cp} cuts each sequence into 2 x cp = {2 * cp} chunks (a head and a tail per "
                                f"rank, so causal attention costs each the same), and model.seq_len={seq_len} does not "
                                f"divide; valid: {', '.join(map(str, fits[:12]))}")
    return seq_len // cp


def _value(node: fx.Node) -> tuple[tuple[int, ...], torch.dtype] | None:
    """A node's output shape and dtype, from export's fake value or fx's shape propagation."""
    meta = node.meta.get("val", node.meta.get("tensor_meta"))
    shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
    return (tuple(int(d) for d in shape), dtype) if shape is not None and dtype is not None else None


def _where(node: fx.Node) -> str:
    return (innermost_module(node) or "the model's forward").removeprefix("model.").removeprefix("inner.")


def _is_positions(node: fx.Node, length: int) -> bool:
    """An integer arange 0..length-1: the positions of the rank's tokens."""
    value = _value(node)
    if value is None or value[0] != (length,) or value[1].is_floating_point:
        return False
    args = list(node.args)
    if node.target is aten.arange.default or (node.target is torch.arange and len(args) == 1):
        return True
    start = args[0] if args else node.kwargs.get("start", 0)
    step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
    return start == 0 and step == 1


def _attention_arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _as_documents(node: fx.Node, documents: fx.Node) -> None:
    """An attention given the model's packed-document mask, made to take the data's position ids
    instead (causal within each document: what the mask built from them says), so the cp
    kernels can find each token's document on every rank."""
    dropout = _attention_arg(node, 4, "dropout_p", 0.0)
    kept = {k: v for k, v in node.kwargs.items() if k in ("scale", "enable_gqa")}
    node.args = tuple(node.args[:3])
    node.kwargs = {"dropout_p": dropout, "is_causal": True, **kept, "position_ids": documents}


def _check_attention(node: fx.Node, cp: int) -> None:
    """Refuse an attention call the cp kernels cannot compute exactly."""
    if _attention_arg(node, 3, "attn_mask", None) is not None:
        raise ConfigError("cp", f"cp={cp}: the attention in {_where(node)} is given a mask, built over the positions "
                                "one rank holds; a split sequence needs the mask of the whole one. Call "
                                "scaled_dot_product_attention with is_causal=True (and no mask) for causal "
                                "attention, or set cp=1")
    dropout = _attention_arg(node, 4, "dropout_p", 0.0)
    if not isinstance(dropout, (int, float)) or dropout:
        raise ConfigError("model.dropout", f"cp={cp}: the attention in {_where(node)} drops out its probabilities "
                                           f"(dropout_p={dropout}), which the cp kernels do not; set its dropout to 0, "
                                           "or cp=1")


def _check_scores(gm: fx.GraphModule, length: int, cp: int) -> None:
    """Refuse a softmax over [.., t, t]: attention scores materialised by the model itself."""
    for node in gm.graph.nodes:
        value = _value(node) if node.op == "call_function" and node.target in SOFTMAX else None
        if value is not None and len(value[0]) >= 2 and value[0][-2:] == (length, length):
            raise ConfigError("cp", f"cp={cp}: {_where(node)} computes attention its own way (a softmax over "
                                    f"[.., {length}, {length}] scores it builds itself), which cannot be split "
                                    "over the cp ranks; attention through torch's scaled_dot_product_attention "
                                    "splits (a transformers model with attn_implementation=sdpa), or set cp=1")


def split_attention(traced: TracedModel, length: int, cp: int, documents: str | None = None,
                    leaves: Sequence[str] = ()) -> dict[str, int]:
    """Retarget `traced`'s attention and position calls for cp (module docstring), in place, on a
    graph traced at the rank's `length` (1/cp of the sequence). `documents`: the placeholder of
    the data's per-document position ids (packed documents), which then replaces the masks the
    model built from them (their now unused nodes removed, and the cost graph made again;
    `leaves`: its leaf modules). Returns how many of each it rewrote; raises ConfigError for what
    cannot be split."""
    gm = traced.gm
    _check_scores(gm, length, cp)
    attentions = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA]
    if not attentions:
        raise ConfigError("cp", f"cp={cp} splits attention over the cp ranks, and this model's traced graph calls no "
                                "scaled_dot_product_attention (it computes attention its own way, or inside a module "
                                "named in model.leaf_modules, which the trace keeps whole); set cp=1")
    ids = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == documents), None)
    masked = [n for n in attentions if _attention_arg(n, 3, "attn_mask", None) is not None] if ids is not None else []
    for node in attentions:
        if node in masked:
            _as_documents(node, ids)
        _check_attention(node, cp)
        node.target = cp_compute.sdpa
    positions = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ARANGE
                 and _is_positions(n, length)]
    for node in positions:
        node.target = cp_compute.arange
    if masked:  # the mask's nodes have no user left: gone, and the planner's graph without them
        gm.graph.eliminate_dead_code()
        traced.graph = build_cost_graph(gm, leaves)
    gm.recompile()
    return {"attention": len(attentions), "positions": len(positions), "documents": len(masked)}
