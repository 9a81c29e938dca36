"""Cost graphs made up for tests and benchmarks: random layered DAGs, and chains from per-node costs."""

from __future__ import annotations

import random
from collections.abc import Sequence

import networkx as nx


def synthetic_dag(
    num_nodes: int,
    width: int = 8,
    skip_prob: float = 0.1,
    max_skip: int = 6,
    seed: int = 0,
) -> nx.DiGraph:
    """A random layered DAG with skips and lognormal costs: a stand-in for big traced models.

    Layers of about `width` nodes; each node reads one or two nodes of the previous layer and, with
    probability `skip_prob`, one node up to `max_skip` layers back.
    """
    rng = random.Random(seed)
    g = nx.DiGraph()
    layers: list[list[str]] = []
    count = 0
    while count < num_nodes:
        w = min(max(1, int(rng.gauss(width, width / 3))), num_nodes - count)
        layer = []
        for _ in range(w):
            name = f"n{count}"
            fwd = rng.lognormvariate(-9.0, 1.0)
            g.add_node(
                name,
                forward_s=fwd,
                backward_s=fwd * rng.uniform(1.0, 3.0),
                activation_bytes=rng.randint(1, 64) * 4096,
                output_bytes=rng.randint(1, 16) * 4096,
                param_bytes=rng.choice([0, 0, 4096, 65536, 262144]),
                order=count,
            )
            if layers:
                prev = layers[-1]
                for src in rng.sample(prev, min(len(prev), rng.choice([1, 1, 2]))):
                    g.add_edge(src, name)
                if len(layers) > 1 and rng.random() < skip_prob:
                    back = layers[-rng.randint(2, min(max_skip, len(layers)))]
                    g.add_edge(rng.choice(back), name)
            layer.append(name)
            count += 1
        layers.append(layer)
    return g


def chain(
    costs: Sequence[float], output_bytes: int | Sequence[int] = 0, activation_bytes: int = 0
) -> nx.DiGraph:
    """A chain cost graph from per-node seconds (backward counted as zero): handy in tests and docs."""
    g = nx.DiGraph()
    outs = [output_bytes] * len(costs) if isinstance(output_bytes, int) else list(output_bytes)
    for i, c in enumerate(costs):
        g.add_node(
            f"b{i}",
            forward_s=float(c),
            backward_s=0.0,
            output_bytes=outs[i],
            activation_bytes=activation_bytes,
            param_bytes=0,
            order=i,
        )
        if i:
            g.add_edge(f"b{i - 1}", f"b{i}")
    return g
