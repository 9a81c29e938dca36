"""Whole-DAG partitioning as a mixed-integer program (scipy.optimize.milp, i.e. HiGHS).

Why a MILP on top of `balanced`: a contiguous split of one topological order cannot move a side
branch to a different stage than its neighbours in that order; the MILP may place any node in any
stage as long as no edge goes backwards. It is solved on a coarsened graph (chains contracted, then
tiny neighbours merged along a topological order) so thousands of nodes stay tractable, under a time
limit; the contiguous DP result is computed first and kept whenever the MILP does not beat it.

Formulation, k stages, coarse node v with cost c_v:
  z[v,s] in {0,1} for s=1..k-1 means "stage(v) >= s"; z[v,s+1] <= z[v,s]; x[v,s] = z[v,s] - z[v,s+1]
  precedence u->v:            z[u,s] <= z[v,s] for every s
  each stage non-empty:       sum_v x[v,s] >= 1
  send of value u, s < t:     g[u,s,t] >= x[U,s] + x[V,t] - 1 for each coarse consumer V of u
  stage time:                 sum_v c_v x[v,s] + sum_{u,t} bytes_u g[u,s,t] / bandwidth <= T
  memory (optional):          sum_v (params_v + act_v * in_flight_s) x[v,s] + tied params once <= cap
  minimise T.
The g terms charge a value once per distinct later consumer stage, exactly as `evaluate` does.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.derived import sent_bytes
from pipelaunch.pipeline.planner.partition.balanced import balanced, min_memory_cap
from pipelaunch.pipeline.planner.partition.common import (
    DEFAULT_BANDWIDTH,
    Partition,
    _node_params,
    check_stages,
    evaluate,
    in_flight_list,
    memory_error,
    node_cost,
    topo_order,
)


@dataclass
class Coarse:
    """A quotient DAG: `groups[i]` are the original nodes merged into coarse node i."""

    groups: list[list[str]]
    group_of: dict[str, int]
    graph: nx.DiGraph  # nodes 0..N-1, in a topological order


def _quotient(graph: nx.DiGraph, group_of: dict[str, int], n_groups: int) -> nx.DiGraph:
    q = nx.DiGraph()
    q.add_nodes_from(range(n_groups))
    q.add_edges_from((group_of[u], group_of[v]) for u, v in graph.edges if group_of[u] != group_of[v])
    return q


def coarsen(graph: nx.DiGraph, max_nodes: int = 200, order: Sequence[str] | None = None) -> Coarse:
    """Contract chains, then merge neighbours in topological order until at most ~max_nodes remain.

    Both steps keep the quotient acyclic: a chain link u->v (u's only successor, v's only predecessor)
    has no other path, and a contiguous range of a topological order has no path leaving and re-entering.
    """
    order = list(order) if order is not None else topo_order(graph)
    pos = {n: i for i, n in enumerate(order)}
    # 1. chains: walk in order, attach v to u's group when the link u->v is the only way in and out,
    #    as long as the group stays below an average coarse node's cost (a chain can still be cut)
    cap = sum(node_cost(graph, n) for n in order) / max(max_nodes, 1)
    group_of: dict[str, int] = {}
    groups: list[list[str]] = []
    group_cost: list[float] = []
    for v in order:
        preds = list(graph.predecessors(v))
        c = node_cost(graph, v)
        if len(preds) == 1 and graph.out_degree(preds[0]) == 1 and group_cost[group_of[preds[0]]] + c <= cap:
            gid = group_of[preds[0]]
        else:
            gid = len(groups)
            groups.append([])
            group_cost.append(0.0)
        group_of[v] = gid
        groups[gid].append(v)
        group_cost[gid] += c
    # 2. merge along a topological order of the quotient until small enough
    while len(groups) > max_nodes:
        q = _quotient(graph, group_of, len(groups))
        first = [pos[g[0]] for g in groups]
        q_order = list(nx.lexicographical_topological_sort(q, key=lambda i: first[i]))
        costs = [sum(node_cost(graph, n) for n in groups[i]) for i in q_order]
        target = sum(costs) / max_nodes
        merged: list[list[str]] = []
        acc = 0.0
        for i, c in zip(q_order, costs, strict=True):
            if merged and acc + c <= target * 1.0001:
                merged[-1].extend(groups[i])
                acc += c
            else:
                merged.append(list(groups[i]))
                acc = c
        if len(merged) == len(groups):  # nothing merged: costs are all above target; pair them up
            merged = [
                sum((list(groups[i]) for i in q_order[j : j + 2]), []) for j in range(0, len(q_order), 2)
            ]
        groups = merged
        group_of = {n: gi for gi, g in enumerate(groups) for n in g}
    q = _quotient(graph, group_of, len(groups))
    first = [pos[g[0]] if g else 0 for g in groups]
    q_order = list(nx.lexicographical_topological_sort(q, key=lambda i: first[i]))
    renumber = {old: new for new, old in enumerate(q_order)}
    groups = [groups[old] for old in q_order]
    group_of = {n: renumber[g] for n, g in group_of.items()}
    return Coarse(groups, group_of, nx.relabel_nodes(q, renumber))


class _Rows:
    """Sparse constraint rows lb <= A x <= ub, built one dict at a time."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def add(self, coefs: dict[int, float], lb: float, ub: float) -> None:
        row = len(self.lb)
        for col, val in coefs.items():
            if val:
                self.r.append(row)
                self.c.append(col)
                self.v.append(val)
        self.lb.append(lb)
        self.ub.append(ub)

    def constraint(self, n_vars: int):
        """The rows as one sparse scipy.optimize.LinearConstraint."""
        from scipy.optimize import LinearConstraint
        from scipy.sparse import coo_matrix

        a = coo_matrix((self.v, (self.r, self.c)), shape=(len(self.lb), n_vars)).tocsr()
        return LinearConstraint(a, np.array(self.lb), np.array(self.ub))


class _Program:
    """The MILP's columns and rows for k stages over a coarse graph of n nodes.

    Columns: z[v, s] (v in 0..n-1, s in 1..k-1) first, then T, then whatever `extra` hands out
    (send variables g, then shared-parameter variables p), in the order they are asked for."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        self.n_z = n * (k - 1)
        self.t_col = self.n_z
        self.n_vars = self.n_z + 1
        self.rows = _Rows()

    def z(self, v: int, s: int) -> int:
        """Column of z[v, s], s in 1..k-1."""
        return v * (self.k - 1) + (s - 1)

    def x(self, v: int, s: int, coef: float, row: dict[int, float]) -> float:
        """Add coef * x[v,s] to row; returns the constant part (moved to the bounds by the caller)."""
        const = 0.0
        if s == 0:
            const += coef
        else:
            row[self.z(v, s)] = row.get(self.z(v, s), 0.0) + coef
        if s + 1 <= self.k - 1:
            row[self.z(v, s + 1)] = row.get(self.z(v, s + 1), 0.0) - coef
        return const

    def extra(self) -> int:
        """A new continuous column in [0, 1]."""
        self.n_vars += 1
        return self.n_vars - 1


def _add_order_rows(prog: _Program, coarse: Coarse) -> None:
    """z[v, s] falls with s, no edge goes to an earlier stage, and every stage holds a node."""
    n, k, rows = prog.n, prog.k, prog.rows
    for v in range(n):
        for s in range(1, k - 1):
            rows.add({prog.z(v, s + 1): 1.0, prog.z(v, s): -1.0}, -np.inf, 0.0)
    for u, v in coarse.graph.edges:
        for s in range(1, k):
            rows.add({prog.z(u, s): 1.0, prog.z(v, s): -1.0}, -np.inf, 0.0)
    for s in range(k):
        row: dict[int, float] = {}
        const = sum(prog.x(v, s, 1.0, row) for v in range(n))
        rows.add(row, 1.0 - const, np.inf)


def _add_output_rows(prog: _Program, graph: nx.DiGraph, coarse: Coarse) -> None:
    """The model's outputs in the last stage (the loss is computed there): a node no other reads
    could otherwise sit in an earlier stage, before nodes it does not feed."""
    for name in graph.graph.get("outputs", ()):
        if name in coarse.group_of:
            prog.rows.add({prog.z(coarse.group_of[name], prog.k - 1): 1.0}, 1.0, np.inf)


def _outputs_last(part: Partition, graph: nx.DiGraph) -> bool:
    return all(part.assignment.get(n, part.num_stages - 1) == part.num_stages - 1 for n in graph.graph.get("outputs", ()))


def _add_time_rows(prog: _Program, graph: nx.DiGraph, coarse: Coarse, cost: list[float], bandwidth: float) -> None:
    """Each stage's compute plus the sends it starts stays under T; a send g[u, s, t] (one per value
    crossing groups and s < t) is forced to 1 when u's group is in s and a consumer's group in t."""
    n, k, rows = prog.n, prog.k, prog.rows
    inv_bw = 0.0 if not bandwidth or bandwidth == float("inf") else 1.0 / bandwidth
    time_rows: list[dict[int, float]] = [{} for _ in range(k)]
    time_const = [0.0] * k
    for s in range(k):
        for v in range(n):
            time_const[s] += prog.x(v, s, cost[v], time_rows[s])
    if inv_bw and k > 1:
        for u in graph.nodes:
            gu = coarse.group_of[u]
            consumers = sorted({coarse.group_of[w] for w in graph.successors(u)} - {gu})
            nbytes = float(sent_bytes(graph.nodes[u]))
            if not consumers or nbytes <= 0:
                continue
            for s in range(k - 1):
                for t in range(s + 1, k):
                    col = prog.extra()
                    time_rows[s][col] = nbytes * inv_bw
                    for cv in consumers:
                        row = {col: -1.0}
                        const = prog.x(gu, s, 1.0, row) + prog.x(cv, t, 1.0, row)
                        rows.add(row, -np.inf, 1.0 - const)
    for s in range(k):
        time_rows[s][prog.t_col] = -1.0
        rows.add(time_rows[s], -np.inf, -time_const[s])


def _add_memory_rows(
    prog: _Program, graph: nx.DiGraph, coarse: Coarse, flights: list[int], memory_cap: float
) -> None:
    """Each stage's parameters and in-flight activations stay under the cap; a parameter used by
    several coarse nodes is counted once per stage, through p[param, s] >= x[v, s] for each user v."""
    n, k, rows = prog.n, prog.k, prog.rows
    act = [sum(float(graph.nodes[v].get("activation_bytes", 0)) for v in g) for g in coarse.groups]
    users: dict[str, set[int]] = {}
    sizes: dict[str, int] = {}
    for v, g in enumerate(coarse.groups):
        for node in g:
            for p, size in _node_params(graph, node).items():
                users.setdefault(p, set()).add(v)
                sizes[p] = size
    own = [0.0] * n
    shared = {p: vs for p, vs in users.items() if len(vs) > 1}
    for p, vs in users.items():
        if len(vs) == 1:
            own[next(iter(vs))] += sizes[p]
    p_cols = {(p, s): prog.extra() for p in shared for s in range(k)}
    for s in range(k):
        row: dict[int, float] = {}
        const = sum(prog.x(v, s, own[v] + act[v] * flights[s], row) for v in range(n))
        for p in shared:
            row[p_cols[p, s]] = float(sizes[p])
        rows.add(row, -np.inf, memory_cap - const)
        for p, vs in shared.items():
            for v in vs:
                prow = {p_cols[p, s]: -1.0}
                pconst = prog.x(v, s, 1.0, prow)
                rows.add(prow, -np.inf, -pconst)


def _run_highs(prog: _Program, lb_t: float, time_limit: float, mip_gap: float) -> tuple[list[int] | None, dict]:
    """Minimise T (at least `lb_t`) with integral z; each coarse node's stage and the solver's facts."""
    from scipy.optimize import Bounds, milp  # imported when a MILP runs: every other command skips it

    n_vars = prog.n_vars
    c = np.zeros(n_vars)
    c[prog.t_col] = 1.0
    integrality = np.zeros(n_vars)
    integrality[: prog.n_z] = 1
    lower = np.zeros(n_vars)
    upper = np.ones(n_vars)
    lower[prog.t_col], upper[prog.t_col] = lb_t, np.inf
    t0 = time.perf_counter()
    res = milp(
        c,
        integrality=integrality,
        bounds=Bounds(lower, upper),
        constraints=[prog.rows.constraint(n_vars)],
        options={"time_limit": float(time_limit), "mip_rel_gap": float(mip_gap), "disp": False},
    )
    facts = {
        "solve_s": time.perf_counter() - t0,
        "status": int(res.status),
        "message": str(res.message),
        "coarse_nodes": prog.n,
        "variables": n_vars,
        "constraints": len(prog.rows.lb),
        "objective": float(res.fun) if res.x is not None else None,
        "mip_gap": float(getattr(res, "mip_gap", float("nan")) or 0.0) if res.x is not None else None,
    }
    if res.x is None:
        return None, facts
    zs = np.round(res.x[: prog.n_z]).astype(int).reshape(prog.n, prog.k - 1)
    return [int(r.sum()) for r in zs], facts


def _solve(
    graph: nx.DiGraph,
    coarse: Coarse,
    k: int,
    bandwidth: float,
    memory_cap: float | None,
    flights: list[int],
    time_limit: float,
    mip_gap: float,
) -> tuple[list[int] | None, dict]:
    """Stage of each coarse node (None if no feasible solution in time) and solver facts."""
    cost = [sum(node_cost(graph, v) for v in g) for g in coarse.groups]
    prog = _Program(len(coarse.groups), k)
    _add_order_rows(prog, coarse)
    _add_output_rows(prog, graph, coarse)
    _add_time_rows(prog, graph, coarse, cost, bandwidth)
    if memory_cap is not None:
        _add_memory_rows(prog, graph, coarse, flights, memory_cap)
    lb_t = max(sum(cost) / k, max(cost, default=0.0))
    return _run_highs(prog, lb_t, time_limit, mip_gap)


def milp_partition(
    graph: nx.DiGraph,
    num_stages: int,
    bandwidth: float = DEFAULT_BANDWIDTH,
    memory_cap: float | None = None,
    in_flight: int | Sequence[int] = 1,
    time_limit: float = 5.0,
    mip_gap: float = 1e-3,
    max_nodes: int = 200,
    order: Sequence[str] | None = None,
) -> Partition:
    """Minimise the slowest stage over all valid DAG splits (coarsened to `max_nodes`), never worse
    than `balanced`; falls back to it with a warning when HiGHS finds nothing within `time_limit` s."""
    check_stages(graph, num_stages)
    k = num_stages
    flights = in_flight_list(in_flight, k)
    order = list(order) if order is not None else topo_order(graph)
    t0 = time.perf_counter()
    bal: Partition | None = None
    bal_error: ConfigError | None = None
    try:
        bal = balanced(graph, k, bandwidth, memory_cap, flights, order)
    except ConfigError as e:
        bal_error = e
    if k == 1:
        assert bal is not None or bal_error is not None
        if bal is None:
            raise bal_error  # type: ignore[misc]
        bal.method = "milp"
        return bal
    coarse = coarsen(graph, max(max_nodes, k), order)
    if len(coarse.groups) < k:  # over-coarsened: keep enough pieces to fill every stage
        coarse = coarsen(graph, graph.number_of_nodes(), order)
    stages, facts = _solve(graph, coarse, k, bandwidth, memory_cap, flights, time_limit, mip_gap)
    facts["total_s"] = time.perf_counter() - t0
    if stages is None:
        if facts["status"] == 2 and memory_cap is not None:  # proven infeasible under the cap
            raise memory_error(min_memory_cap(graph, k, flights, order), memory_cap)
        if bal is None:
            raise bal_error  # type: ignore[misc]
        warnings.warn(
            f"milp partitioner found no feasible split in {time_limit}s ({facts['message']}); "
            "using the balanced partitioner's split instead",
            RuntimeWarning,
            stacklevel=2,
        )
        bal.method = "milp->balanced"
        bal.info.update(facts)
        return bal
    assignment = {n: stages[coarse.group_of[n]] for n in graph.nodes}
    part = evaluate(graph, assignment, k, bandwidth, flights, "milp")
    facts["milp_bottleneck_s"] = part.bottleneck_s
    # polish: the MILP's stages, read as one topological order, re-cut at node granularity by the DP
    index = {n: i for i, n in enumerate(order)}
    reordered = sorted(order, key=lambda n: (assignment[n], index[n]))
    try:
        polished = balanced(graph, k, bandwidth, memory_cap, flights, reordered)
        facts["polished_bottleneck_s"] = polished.bottleneck_s
        if polished.bottleneck_s < part.bottleneck_s and _outputs_last(polished, graph):
            part = polished
            part.method = "milp"
    except ConfigError:
        pass
    if bal is not None:
        facts["balanced_bottleneck_s"] = bal.bottleneck_s
        if bal.bottleneck_s < part.bottleneck_s and _outputs_last(bal, graph):
            bal.method = "milp"
            bal.info.update(facts, chosen="balanced")
            return bal
    part.info.update(facts, chosen="milp")
    return part
