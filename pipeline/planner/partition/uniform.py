"""Equal numbers of nodes, blocks or layers per stage: the baseline every smarter partitioner must beat."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import networkx as nx

from pipelaunch.pipeline.graph.derived import sent_bytes
from pipelaunch.pipeline.planner.partition.common import (
    DEFAULT_BANDWIDTH,
    Partition,
    assignment_from_order,
    check_stages,
    evaluate,
    topo_order,
)


def uniform(
    graph: nx.DiGraph,
    num_stages: int,
    bandwidth: float = DEFAULT_BANDWIDTH,
    in_flight: int | Sequence[int] = 1,
    order: Sequence[str] | None = None,
) -> Partition:
    """Contiguous stages of the topological order; the first `n % k` stages get one extra node."""
    check_stages(graph, num_stages)
    order = list(order) if order is not None else topo_order(graph)
    base, extra = divmod(len(order), num_stages)
    starts, at = [], 0
    for s in range(num_stages):
        starts.append(at)
        at += base + (1 if s < extra else 0)
    return evaluate(graph, assignment_from_order(order, starts), num_stages, bandwidth, in_flight, "uniform")


#: a name component that numbers its module in its own name: `layer0`, `block11`, `h3`
NUMBERED = re.compile(r"([A-Za-z_]+?)(\d+)")


def layer_container(names: Iterable[str]) -> tuple[str, dict[str, int]] | None:
    """The repeated layer list among dotted module (or tensor) names, found by shape rather than by
    name: for each name its outermost numbered component, either a `<prefix>.<int>` (Llama's
    `model.layers`, GPT-2's `transformer.h`) or a component numbered in its own name (a chain of
    blocks `layer0` .. `layer31`, prefix `layer`); inner ones (experts inside a layer) do not count.
    The prefix whose indices run 0..L-1 with the largest L >= 2 wins. Returns (prefix, name -> layer
    index for the names inside it), or None when there is no such list or two tie (a U-Net's
    `encoders` and `decoders`)."""
    found: dict[str, dict[str, int]] = {}
    for name in names:
        parts = name.split(".")
        for i, p in enumerate(parts):
            if p.isdigit() and i > 0:
                found.setdefault(".".join(parts[:i]), {})[name] = int(p)
                break
            numbered = NUMBERED.fullmatch(p)
            if numbered is not None:
                found.setdefault(".".join([*parts[:i], numbered[1]]), {})[name] = int(numbered[2])
                break
    sizes = {prefix: len(set(idx.values())) for prefix, idx in found.items()
             if set(idx.values()) == set(range(len(set(idx.values()))))}
    best = max(sizes.values(), default=0)
    winners = [p for p, n in sizes.items() if n == best]
    if best < 2 or len(winners) != 1:
        return None
    return winners[0], found[winners[0]]


def layer_starts(graph: nx.DiGraph, order: Sequence[str], num_stages: int) -> list[int] | None:
    """Where each stage begins for equal numbers of whole layers per stage (the counts differ by at
    most one, the earlier stages taking the extra), or None when the graph holds no layer list: no
    list among the nodes' parameter names, fewer layers than stages, or layers that interleave. A layer is the
    nodes holding its parameters (one node each in a chain of blocks, or once the planner contracts
    a decoder layer); each cut goes where the fewest bytes cross in the parameter-free ops between
    two layers (the residual stream, not the middle of a norm). The
    nodes before the first layer (embedding, masks) go with stage 0, those after the last (final
    norm, head) with the last stage, neither counting as a layer, as Megatron's
    account-for-embedding/loss options leave them out. Reads only `params`, `output_bytes` and the
    edges, so it works on the contracted graph the planner cuts as on the traced one."""
    found = layer_container({p for n in order for p in graph.nodes[n].get("params") or []})
    if found is None:
        return None
    _, layer_of = found
    pos = {n: i for i, n in enumerate(order)}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    count: dict[int, int] = {}
    for i, n in enumerate(order):
        layers = {layer_of[p] for p in graph.nodes[n].get("params") or [] if p in layer_of}
        if len(layers) > 1:
            return None
        for j in layers:
            first.setdefault(j, i)
            last[j] = i
            count[j] = count.get(j, 0) + 1
    num_layers = len(count)
    if num_layers < num_stages:
        return None
    if any(last[j] >= first[j + 1] for j in range(num_layers - 1)):
        return None

    def crossing(at: int) -> int:
        """Bytes sent when a stage begins at position `at` (each value once)."""
        return sum(sent_bytes(graph.nodes[u]) for u in order[:at]
                   if any(pos[v] >= at for v in graph.successors(u)))

    base, extra = divmod(num_layers, num_stages)
    starts, layer = [0], 0
    for s in range(num_stages - 1):
        layer += base + (1 if s < extra else 0)
        gap = range(last[layer - 1] + 1, first[layer] + 1)
        starts.append(min(gap, key=lambda at: (crossing(at), at)))
    return starts
