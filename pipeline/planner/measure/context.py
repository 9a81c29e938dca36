"""One cp rank's attention priced beyond the trace: what the planner adds under cp > 1.

The model is traced and measured on one rank's 1/cp of the positions (`model=gpt`'s input shape
under cp), so every per-position cost, the activations and the messages are the rank's own. What
the trace cannot see is that the rank's queries meet every rank's keys: its attention computes cp
times what the traced, local causal attention computes (the head-tail balance gives each rank
1/cp of the whole causal score matrix, cp times its local share), and the keys and values cross
the cp group.

Attention's share of a node: an attention node (op granularity) is all attention; a block holding
`CausalSelfAttention`s is split by FLOPs, 2·b·heads·t²·d for its causal attention against
2·b·t·(its matmul weights) for the rest, and that share of the node's measured (or priced) time
is added cp − 1 times over, forward and backward (in the input-gradient half under a split
backward: attention has no weights).

The exchanges, per attention and micro-batch (pipeline/compute/ring_attention.py,
ulysses_attention.py), added to the node's time as issued in line (a bound: the ring posts each
step before its block, so on a device that computes and communicates at once some of it hides):
- ring: forward cp − 1 rotations of the keys and values (2·b·kv_heads·t·d in the compute dtype:
  under grouped-query attention the keys' heads, `kv_heads`), backward as many and cp of their
  fp32 gradients;
- alltoall: forward q, k, v to positions and the output back, each a rank's (cp − 1)/cp of
  b·heads·t·d (k and v at their own heads); the backward the same four reversed.
"""

from __future__ import annotations

from torch import nn

from pipelaunch.pipeline.compute.context_parallel import attention as context_attention
from pipelaunch.pipeline.compute.context_parallel import sdpa as context_sdpa
from pipelaunch.pipeline.graph.trace import TracedModel


def _attentions(module: nn.Module) -> list[nn.Module]:
    """The attention modules that attend over the cp group (`model.attention=context`)."""
    return [m for m in module.modules() if getattr(m, "context", None) is True and hasattr(m, "head_dim")]


def _out_shape(node_meta: dict) -> list[int] | None:
    """A node's output shape (a block's: the hidden states [b, t, dim]; an attention call's
    [b, heads, t, d]), None for other outputs."""
    shape = node_meta.get("shape")
    return [int(x) for x in shape[0]] if isinstance(shape, (list, tuple)) and shape and \
        isinstance(shape[0], (list, tuple)) and all(isinstance(x, int) for x in shape[0]) else None


def attention_share(traced: TracedModel, name: str, calls: set[str] | None = None
                    ) -> tuple[float, list[tuple[int, int, int, int]]]:
    """Node `name`'s share of its time that is attention, and its attentions' (b, heads, t, d).
    `calls`: the graph's calls of the cp attention by node name (`attention_calls`)."""
    gm, node = traced.gm, traced.graph.nodes[name]
    target = node.get("target")
    shape = _out_shape(node)
    if node.get("op") == "call_function" and name in (attention_calls(traced) if calls is None else calls):
        return (1.0, [tuple(shape)]) if shape is not None and len(shape) == 4 else (0.0, [])
    if node.get("op") != "call_module":
        return 0.0, []
    found = _attentions(gm.get_submodule(str(target)))
    if not found or shape is None or len(shape) != 3:
        return 0.0, []
    module = gm.get_submodule(str(target))
    b, t = shape[0], shape[1]
    # the heads this rank computes: under tp its slice of q's rows (the rewrite shards the weight,
    # not the Linear's `out_features`)
    shapes = [(b, m.q.weight.shape[0] // m.head_dim, t, m.head_dim) for m in found]
    attention = sum(2.0 * b * h * t * t * d for b, h, t, d in shapes)
    weights = sum(p.numel() for n, p in module.named_parameters() if p.dim() == 2)
    return attention / (attention + 2.0 * b * t * weights), shapes


def attention_calls(traced: TracedModel) -> set[str]:
    """The nodes calling the cp attention itself (op granularity): model=gpt's, or a traced model's
    own attention calls retargeted (pipeline/graph/context_parallel.py)."""
    return {n.name for n in traced.gm.graph.nodes
            if n.op == "call_function" and n.target in (context_attention, context_sdpa)}


def exchange_s(shape: tuple[int, int, int, int], cp: int, method: str, link: tuple[float, float],
               compute_bytes: float, kv_heads: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one attention's cp exchanges on `link` (latency, bandwidth);
    `kv_heads`: the heads of its keys and values where fewer than the queries' (grouped-query
    attention: the ring moves those), default the queries'."""
    latency, bandwidth = link
    b, h, t, d = shape
    block, kv_block = b * h * t * d, b * (kv_heads or h) * t * d
    if method == "ring":
        kv = 2 * kv_block * compute_bytes
        forward = (cp - 1) * (latency + kv / bandwidth)
        return forward, forward + cp * (latency + 2 * kv_block * 4 / bandwidth)
    # q and the output at the queries' heads, k and v at theirs where those divide by cp (else
    # repeated to the queries': compute.context_parallel._for_kernel): each a rank's (cp - 1) / cp
    kv_block = kv_block if (kv_heads or h) % cp == 0 else block
    moved = (2 * block + 2 * kv_block) * compute_bytes * (cp - 1) / cp / bandwidth
    return 4 * latency + moved, 4 * latency + moved


def kv_heads(traced: TracedModel, name: str, calls: set[str]) -> list[int | None]:
    """Per attention of node `name` (as `attention_share` lists them), its keys' heads: a call's
    key argument's (transformers' sdpa passes grouped-query keys unrepeated), a module's k rows
    over its head width (model=gpt: the queries'); None where unknown."""
    node = traced.graph.nodes[name]
    if node.get("op") == "call_function" and name in calls:
        call = next((n for n in traced.gm.graph.nodes if n.name == name), None)
        key = call.args[1] if call is not None and len(call.args) > 1 else None
        meta = getattr(key, "meta", {}) if key is not None else {}
        value = meta.get("val", meta.get("tensor_meta"))
        shape = getattr(value, "shape", None)
        return [int(shape[1])] if shape is not None and len(shape) == 4 else [None]
    if node.get("op") != "call_module":
        return []
    found = _attentions(traced.gm.get_submodule(str(node.get("target"))))
    return [m.k.weight.shape[0] // m.head_dim if hasattr(m, "k") else None for m in found]


def add_context_costs(traced: TracedModel, cp: int, method: str, link: tuple[float, float],
                      compute_bytes: float = 4.0) -> None:
    """Each attention node's cost under cp (module docstring), in place: its times (where
    profiled) and `cp_exchange_s` (forward, backward seconds of its exchanges). `compute_bytes`:
    the bytes of an element in the dtype attention computes in."""
    g, calls = traced.graph, attention_calls(traced)
    for name in g.nodes:
        share, shapes = attention_share(traced, name, calls)
        if not shapes:
            continue
        node = g.nodes[name]
        heads = kv_heads(traced, name, calls)
        heads = heads if len(heads) == len(shapes) else [None] * len(shapes)
        fwd_x, bwd_x = (sum(x) for x in zip(*(exchange_s(s, cp, method, link, compute_bytes, kv)
                                               for s, kv in zip(shapes, heads, strict=True)), strict=True))
        node["cp_exchange_s"] = (fwd_x, bwd_x)
        if "model_flops" in g.graph:  # the rank's queries meet cp times the traced keys (torch's sdpa count)
            g.graph["model_flops"] += (cp - 1) * sum(12.0 * b * h * t * t * d for b, h, t, d in shapes)
        if "forward_s" in node:
            node["forward_s"] += (cp - 1) * share * node["forward_s"] + fwd_x
        for key in ("backward_s", "backward_input_s"):
            if key in node:
                node[key] += (cp - 1) * share * node[key] + bwd_x
    g.graph["cp"] = cp
