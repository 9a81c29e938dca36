"""Optimal contiguous split of a topological order: minimise the slowest stage, under a memory cap.

Why dynamic programming rather than a greedy binary search on the bottleneck: with communication in
the stage time, lengthening a stage can make it cheaper (its boundary moves past a big tensor), so the
greedy feasibility test is not monotone. The DP over (stage, end position) is exact for any costs; it
is vectorised over the start position, O(k * n^2) arithmetic in numpy, fine for 10^4 nodes.

Exactness caveat for DAGs: inside the DP a value leaving a stage is charged once, because which later
stages read it is not known yet. `evaluate` (the judge) charges once per distinct consumer stage, so
for values with consumers in several later stages the DP optimum is a heuristic; for chains and any
graph whose values are read by at most one later stage it is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import numpy as np

from pipelaunch.pipeline.graph.derived import sent_bytes
from pipelaunch.pipeline.planner.partition.common import (
    DEFAULT_BANDWIDTH,
    Partition,
    _node_params,
    assignment_from_order,
    check_stages,
    evaluate,
    in_flight_list,
    memory_error,
    node_cost,
    topo_order,
)


class _Segments:
    """Vectorised per-segment costs of a fixed order: time and memory of every [i, j)."""

    def __init__(self, graph: nx.DiGraph, order: Sequence[str], bandwidth: float) -> None:
        n = len(order)
        pos = {node: i for i, node in enumerate(order)}
        cost = np.array([node_cost(graph, v) for v in order])
        fwd = np.array([float(graph.nodes[v].get("forward_s", 0.0)) for v in order])
        act = np.array([float(graph.nodes[v].get("activation_bytes", 0)) for v in order])
        out = np.array([float(sent_bytes(graph.nodes[v])) for v in order])
        self.maxpos = np.array([max((pos[w] for w in graph.successors(v)), default=-1) for v in order])
        # bytes entering a stage that starts at i: values made before i and read at i or later
        delta = np.zeros(n + 1)
        for v in range(n):
            if self.maxpos[v] > v:
                delta[v + 1] += out[v]
                delta[self.maxpos[v] + 1] -= out[v]
        self.inputs_at = np.cumsum(delta)[:n]
        self.cum_cost = np.concatenate([[0.0], np.cumsum(cost)])
        self.cum_fwd = np.concatenate([[0.0], np.cumsum(fwd)])
        self.cum_act = np.concatenate([[0.0], np.cumsum(act)])
        self.out = out
        self.inv_bw = 0.0 if not bandwidth or bandwidth == float("inf") else 1.0 / bandwidth
        users: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        for i, v in enumerate(order):
            for p, size in _node_params(graph, v).items():
                users.setdefault(p, []).append(i)
                sizes[p] = size
        own = np.zeros(n)
        self.shared: list[tuple[np.ndarray, int]] = []
        for p, where in users.items():
            if len(set(where)) == 1:
                own[where[0]] += sizes[p]
            else:
                self.shared.append((np.array(sorted(set(where))), sizes[p]))
        self.cum_param = np.concatenate([[0.0], np.cumsum(own)])
        self.n = n

    def time(self, j: int) -> np.ndarray:
        """Seconds of segment [i, j) for i = 0..j-1: compute plus sends of values read at or after j."""
        compute = self.cum_cost[j] - self.cum_cost[:j]
        if self.inv_bw == 0.0:
            return compute
        w = np.where(self.maxpos[:j] >= j, self.out[:j], 0.0)
        sent = np.cumsum(w[::-1])[::-1]  # sent[i] = sum of w[i:j]
        return compute + sent * self.inv_bw

    def memory(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """(parameter bytes, activation bytes) of segment [i, j) for i = 0..j-1; tied params once."""
        params = self.cum_param[j] - self.cum_param[:j]
        for where, size in self.shared:
            before = where[where < j]
            if before.size:
                params[: before[-1] + 1] += size
        return params, self.cum_act[j] - self.cum_act[:j]


def _minmax_dp(
    seg: _Segments,
    k: int,
    flights: list[int],
    cap: float | None,
    objective: str,
    remat_flights: list[int] | None = None,
    remat_all: bool = False,
) -> tuple[float, list[int]] | None:
    """Best starts of k contiguous non-empty stages minimising the max of `objective` ("time"/"memory").

    With `remat_flights` a stage over the cap may recompute, or every stage does with `remat_all`
    (as `evaluate` prices it): full activations for remat_flights[s] micro-batches, inputs for
    flights[s], its forward paid twice."""
    n = seg.n
    inf = float("inf")
    best = np.full((k, n + 1), inf)
    choice = np.zeros((k, n + 1), dtype=np.int64)
    for j in range(1, n + 1):
        t = seg.time(j) if objective == "time" else None
        params, act = seg.memory(j) if (cap is not None or objective == "memory") else (None, None)
        fwd = seg.cum_fwd[j] - seg.cum_fwd[:j]
        for s in range(min(k, j)):
            if j > n - (k - 1 - s):
                continue
            mem = params + act * flights[s] if params is not None else None
            remat_mem = (params + act * remat_flights[s] + seg.inputs_at[:j] * flights[s]
                         if remat_flights is not None and params is not None else None)
            if remat_all and remat_flights is not None:
                val = t + fwd if objective == "time" else remat_mem
                if cap is not None:
                    val = np.where(remat_mem <= cap, val, inf)
            elif objective == "time":
                val = t
                if cap is not None and remat_mem is not None:
                    val = np.where(mem <= cap, t, np.where(remat_mem <= cap, t + fwd, inf))
                elif cap is not None:
                    val = np.where(mem <= cap, t, inf)
            else:
                val = mem if remat_mem is None else np.minimum(mem, remat_mem)
                if cap is not None:
                    val = np.where(val <= cap, val, inf)
            if s == 0:
                best[0, j] = val[0]
                choice[0, j] = 0
                continue
            cand = np.maximum(best[s - 1, s:j], val[s:j])
            i = int(np.argmin(cand))
            best[s, j] = cand[i]
            choice[s, j] = i + s
    if not np.isfinite(best[k - 1, n]):
        return None
    starts = [0] * k
    j = n
    for s in range(k - 1, -1, -1):
        starts[s] = int(choice[s, j])
        j = starts[s]
    return float(best[k - 1, n]), starts


def min_memory_cap(
    graph: nx.DiGraph,
    num_stages: int,
    in_flight: int | Sequence[int] = 1,
    order: Sequence[str] | None = None,
    remat_in_flight: Sequence[int] | None = None,
    remat_all: bool = False,
) -> float:
    """The smallest per-stage memory cap any contiguous split of the order can meet (recomputing
    where that holds less, or everywhere with `remat_all`, when `remat_in_flight` is given)."""
    order = list(order) if order is not None else topo_order(graph)
    seg = _Segments(graph, order, 0.0)
    remat = list(remat_in_flight) if remat_in_flight is not None else None
    res = _minmax_dp(seg, num_stages, in_flight_list(in_flight, num_stages), None, "memory", remat, remat_all)
    assert res is not None
    return res[0]


def balanced(
    graph: nx.DiGraph,
    num_stages: int,
    bandwidth: float = DEFAULT_BANDWIDTH,
    memory_cap: float | None = None,
    in_flight: int | Sequence[int] = 1,
    order: Sequence[str] | None = None,
    remat_in_flight: Sequence[int] | None = None,
    remat_all: bool = False,
) -> Partition:
    """The contiguous split of `order` (default: program order) with the smallest bottleneck.

    `memory_cap` bounds each stage's param bytes + activation bytes x `in_flight` (one int, or one per
    stage, e.g. 1F1B's p - s); an impossible cap raises ConfigError stating the smallest that fits.
    With `remat_in_flight` (remat=auto) a stage over the cap may recompute instead, priced as in
    `evaluate`, and the split weighs that recomputation against cutting elsewhere; with `remat_all`
    (remat=full) every stage recomputes and is priced so.
    """
    check_stages(graph, num_stages)
    order = list(order) if order is not None else topo_order(graph)
    flights = in_flight_list(in_flight, num_stages)
    remat = list(remat_in_flight) if remat_in_flight is not None else None
    seg = _Segments(graph, order, bandwidth)
    res = _minmax_dp(seg, num_stages, flights, memory_cap, "time", remat, remat_all)
    if res is None:
        assert memory_cap is not None
        raise memory_error(min_memory_cap(graph, num_stages, flights, order, remat, remat_all), memory_cap,
                           recomputing=remat is not None)
    _, starts = res
    part = evaluate(graph, assignment_from_order(order, starts), num_stages, bandwidth, flights, "balanced",
                    remat_in_flight=remat, memory_cap=memory_cap, remat_all=remat_all)
    part.info["starts"] = starts
    return part
