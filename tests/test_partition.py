"""Partitioners: validity, optimality against brute force, MILP quality and speed, errors."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.planner.partition import (
    balanced,
    coarsen,
    evaluate,
    manual,
    milp_partition,
    min_memory_cap,
    uniform,
    validate_assignment,
)
from pipelaunch.pipeline.planner.partition.common import assignment_from_order
from tests.synthetic import chain, synthetic_dag


def gpt_like_chain(layers: int = 8) -> nx.DiGraph:
    """Fine-grained op costs of a transformer: embedding, per-layer ops, an expensive LM head."""
    ops = [1.0, 3.0, 2.0, 1.0, 0.1, 1.0, 4.0, 0.5, 4.0, 0.1]
    costs = [2.0] + ops * layers + [1.0, 6.0]
    return chain([c * 1e-3 for c in costs], output_bytes=64 * 1024, activation_bytes=256 * 1024)


def brute_force(g: nx.DiGraph, k: int, bandwidth: float, cap: float | None = None, in_flight=1) -> float:
    order = list(g.nodes)
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(order)), k - 1):
        p = evaluate(g, assignment_from_order(order, [0, *cuts]), k, bandwidth, in_flight)
        if cap is None or max(p.stage_memory_bytes) <= cap:
            best = min(best, p.bottleneck_s)
    return best


def test_uniform_counts() -> None:
    g = chain([1.0] * 10)
    p = uniform(g, 4)
    assert [len(s) for s in p.stages()] == [3, 3, 2, 2]
    assert p.lower_bound_s == pytest.approx(2.5)


@pytest.mark.parametrize("seed", range(30))
def test_balanced_is_optimal_on_small_chains(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(3, 9)
    k = rng.randint(1, min(4, n))
    g = chain([rng.random() for _ in range(n)], [rng.randint(0, 2 * 10**8) for _ in range(n)])
    for v in g.nodes:
        g.nodes[v]["activation_bytes"] = rng.randint(1, 100)
        g.nodes[v]["param_bytes"] = rng.randint(0, 100)
    flights = [k - s for s in range(k)]
    assert balanced(g, k, bandwidth=1e9).bottleneck_s == pytest.approx(brute_force(g, k, 1e9))
    cap = min_memory_cap(g, k, flights) * rng.uniform(1.0, 1.5)
    p = balanced(g, k, bandwidth=1e9, memory_cap=cap, in_flight=flights)
    assert max(p.stage_memory_bytes) <= cap
    assert p.bottleneck_s == pytest.approx(brute_force(g, k, 1e9, cap, flights))


@pytest.mark.parametrize("name", ["uniform", "balanced", "milp"])
def test_every_partitioner_gives_a_valid_pipeline_on_a_dag(name: str) -> None:
    g = synthetic_dag(400, seed=5)
    fn = {"uniform": uniform, "balanced": balanced, "milp": milp_partition}[name]
    p = fn(g, 4)
    validate_assignment(g, p.assignment, 4)
    assert all(p.assignment[u] <= p.assignment[v] for u, v in g.edges)
    assert p.bottleneck_s >= p.lower_bound_s * (1 - 1e-9)


def test_validate_rejects_backward_edge() -> None:
    g = chain([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="back to stage"):
        validate_assignment(g, {"b0": 1, "b1": 0, "b2": 1}, 2)


def test_milp_close_to_lower_bound_on_gpt_like_chain() -> None:
    g = gpt_like_chain()
    p = milp_partition(g, 4, bandwidth=float("inf"))
    assert p.bottleneck_s <= 1.05 * p.lower_bound_s
    assert p.bottleneck_s <= balanced(g, 4, bandwidth=float("inf")).bottleneck_s * (1 + 1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_milp_never_worse_than_balanced(seed: int) -> None:
    g = synthetic_dag(600, seed=seed, skip_prob=0.3)
    m = milp_partition(g, 4, bandwidth=1e8, time_limit=5)
    b = balanced(g, 4, bandwidth=1e8)
    assert m.bottleneck_s <= b.bottleneck_s * (1 + 1e-6)


def test_milp_beats_a_bad_order() -> None:
    """Two parallel branches listed one after the other: only a non-contiguous split balances them."""
    g = nx.DiGraph()
    g.add_node("src", forward_s=0.0, order=0)
    for i, branch in enumerate("ab"):
        prev = "src"
        for j in range(4):
            name = f"{branch}{j}"
            g.add_node(name, forward_s=1.0 if branch == "a" else 0.25, order=1 + 4 * i + j)
            g.add_edge(prev, name)
            prev = name
        g.add_edge(prev, "sink")
    g.add_node("sink", forward_s=0.0, order=9)
    order = ["src", "a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3", "sink"]
    b = balanced(g, 2, bandwidth=float("inf"), order=order)
    m = milp_partition(g, 2, bandwidth=float("inf"), order=order)
    assert m.bottleneck_s == pytest.approx(2.5)  # a0, a1 + two b's vs a2, a3 + two b's
    assert b.bottleneck_s == pytest.approx(3.0)


def test_milp_on_2000_nodes() -> None:
    """Solve time is a benchmark (bench/milp_solve_time.py), not asserted here: the machine is shared."""
    g = synthetic_dag(2000, seed=11)
    p = milp_partition(g, 4)
    validate_assignment(g, p.assignment, 4)
    assert p.bottleneck_s <= 1.05 * p.lower_bound_s


def test_coarsen_keeps_a_dag() -> None:
    g = synthetic_dag(1500, seed=2, skip_prob=0.5)
    c = coarsen(g, 100)
    assert len(c.groups) <= 100
    assert nx.is_directed_acyclic_graph(c.graph)
    assert sorted(n for grp in c.groups for n in grp) == sorted(g.nodes)


def test_milp_falls_back_with_warning() -> None:
    g = synthetic_dag(300, seed=3)
    with pytest.warns(RuntimeWarning, match="balanced"):
        p = milp_partition(g, 4, time_limit=0.0)
    assert p.method == "milp->balanced"
    validate_assignment(g, p.assignment, 4)


@pytest.mark.parametrize("fn", [balanced, milp_partition], ids=["balanced", "milp"])
def test_impossible_memory_cap_states_smallest_cap(fn) -> None:
    g = gpt_like_chain(2)
    smallest = min_memory_cap(g, 4, in_flight=[4, 3, 2, 1])
    with pytest.raises(ConfigError, match="memory.cap_bytes") as info:
        fn(g, 4, memory_cap=smallest - 1, in_flight=[4, 3, 2, 1])
    assert f"smallest cap that fits is {int(smallest)} bytes" in str(info.value)
    p = fn(g, 4, memory_cap=smallest, in_flight=[4, 3, 2, 1])
    assert max(p.stage_memory_bytes) <= smallest


def test_tied_params_counted_once_per_stage() -> None:
    g = chain([1.0] * 4)
    g.graph["param_sizes"] = {"w": 100, "v": 10}
    for n, ps in zip(g.nodes, [["w"], ["v"], [], ["w"]], strict=True):
        g.nodes[n]["params"] = ps
    p = evaluate(g, {"b0": 0, "b1": 0, "b2": 1, "b3": 1}, 2)
    assert p.stage_param_bytes == [110, 100]
    q = evaluate(g, {"b0": 0, "b1": 0, "b2": 0, "b3": 0}, 1)
    assert q.stage_param_bytes == [110]


def test_skip_is_charged_once_per_consumer_stage() -> None:
    g = chain([1.0] * 4, output_bytes=1000)
    g.add_edge("b0", "b3")
    p = evaluate(g, {"b0": 0, "b1": 1, "b2": 2, "b3": 3}, 4, bandwidth=1000.0)
    assert p.stage_comm_bytes == [2000, 1000, 1000, 0]
    assert p.stage_time_s == [3.0, 2.0, 2.0, 1.0]


def test_manual_split_points() -> None:
    g = chain([1.0] * 6)
    for i, n in enumerate(g.nodes):
        g.nodes[n]["module"] = f"blocks.{i}.mlp"
    p = manual(g, 3, ["b2", "blocks.4"])
    assert [len(s) for s in p.stages()] == [2, 2, 2]
    with pytest.raises(ConfigError, match="partitioner.split_points") as info:
        manual(g, 3, ["b2", "blocks.9"])
    msg = str(info.value)
    assert "'blocks.9'" in msg and "b0" in msg and "blocks.4.mlp" in msg
    with pytest.raises(ConfigError, match="need 2 split points"):
        manual(g, 3, ["b2"])
    with pytest.raises(ConfigError, match="empty"):
        manual(g, 3, ["b4", "b2"])


def test_recomputing_stage_holds_its_inputs_and_pays_its_forward_again() -> None:
    """evaluate with remat_in_flight: only a stage over the cap recomputes; it then holds full
    activations for remat_in_flight[s] micro-batches and the inputs of all in_flight[s]."""
    g = chain([1.0] * 4, output_bytes=10, activation_bytes=100)
    assignment = assignment_from_order(list(g.nodes), [0, 2])  # two nodes per stage
    plain = evaluate(g, assignment, 2, in_flight=[2, 1])
    assert plain.stage_memory_bytes == [400, 200] and plain.stage_input_bytes == [0, 10]
    part = evaluate(g, assignment, 2, in_flight=[2, 1], remat_in_flight=[1, 1], memory_cap=300)
    assert part.remat_stages == [0] and part.stage_full_in_flight == [1, 1]
    assert part.stage_memory_bytes == [200 + 0 * 2, 200]
    assert part.stage_time_s[0] == pytest.approx(plain.stage_time_s[0] + 2.0)  # both forwards again
    late = evaluate(g, assignment_from_order(list(g.nodes), [0, 1]), 2, in_flight=[1, 3],
                    remat_in_flight=[1, 1], memory_cap=250)
    assert late.remat_stages == [1] and late.stage_memory_bytes == [100, 300 + 10 * 3]


def test_balanced_weighs_recomputation_against_cutting_elsewhere() -> None:
    """With remat allowed, a cap no plain split meets is met by recomputing; and where plain splits
    fit, recomputing a stage is chosen only if it shortens the slowest stage."""
    g = gpt_like_chain(2)
    flights, remat = [4, 3, 2, 1], [1, 1, 1, 1]
    plain_min = min_memory_cap(g, 4, in_flight=flights)
    remat_min = min_memory_cap(g, 4, in_flight=flights, remat_in_flight=remat)
    assert remat_min < plain_min
    with pytest.raises(ConfigError):
        balanced(g, 4, memory_cap=plain_min - 1, in_flight=flights)
    part = balanced(g, 4, memory_cap=plain_min - 1, in_flight=flights, remat_in_flight=remat)
    assert part.remat_stages and max(part.stage_memory_bytes) <= plain_min - 1
    free = balanced(g, 4, in_flight=flights, remat_in_flight=remat)  # no cap: nothing recomputes
    assert free.remat_stages == [] and free.bottleneck_s <= part.bottleneck_s
    roomy = balanced(g, 4, memory_cap=plain_min, in_flight=flights, remat_in_flight=remat)
    assert roomy.bottleneck_s <= balanced(g, 4, memory_cap=plain_min, in_flight=flights).bottleneck_s


def test_full_remat_prices_every_stage_as_recomputing() -> None:
    g = gpt_like_chain(2)
    flights, remat = [4, 3, 2, 1], [1, 1, 1, 1]
    plain = balanced(g, 4, in_flight=flights)
    full = balanced(g, 4, in_flight=flights, remat_in_flight=remat, remat_all=True)
    assert full.remat_stages == [0, 1, 2, 3]
    again = evaluate(g, plain.assignment, 4, in_flight=flights, remat_in_flight=remat, remat_all=True)
    forward = [sum(g.nodes[n]["forward_s"] for n in stage) for stage in plain.stages()]
    assert again.stage_time_s == pytest.approx([t + f for t, f in zip(plain.stage_time_s, forward, strict=True)])
    assert min_memory_cap(g, 4, flights, remat_in_flight=remat, remat_all=True) < min_memory_cap(g, 4, flights)


def test_in_flight_counts_without_a_budget_take_the_first_candidate_order(monkeypatch) -> None:
    """The split's in-flight counts only break ties without a budget, so V-Min's unit-cost search
    stops at its first feasible candidate there; under a cap every candidate is still tried, and
    afterwards the generator searches as before."""
    from pipelaunch.pipeline.planner.fit import budget
    from pipelaunch.pipeline.planner.fit.budget import partition_request
    from pipelaunch.pipeline.planner.schedules import base, build_schedule
    from pipelaunch.pipeline.planner.schedules.v_memory import VMin

    budget._in_flight.cache_clear()  # the counts of a schedule shape are kept: count the orders built afresh
    fills: list[int] = []
    real_fill = base.Candidate.fill
    monkeypatch.setattr(base.Candidate, "fill", lambda self, *a, **k: fills.append(1) or real_fill(self, *a, **k))
    placement = [0, 1, 2, 3, 3, 2, 1, 0]
    generator = VMin()
    partition_request(generator, placement, 16, "none", None, 1e9)
    assert len(fills) == 1
    fills.clear()
    partition_request(generator, placement, 16, "none", 1e9, 1e9)
    budgeted = len(fills)
    assert budgeted > 1
    fills.clear()
    build_schedule(generator, placement, 16)
    assert len(fills) == budgeted


def test_the_first_finished_order_is_not_simulated_when_only_its_shape_is_needed(monkeypatch) -> None:
    """ZBV's first candidate is the paper's finished order: the split's in-flight counts without a
    budget take it without playing it on the costs (a simulation of 98k actions at pp=64); the
    search that chooses the order that runs still plays every candidate."""
    from pipelaunch.pipeline.planner.fit import budget
    from pipelaunch.pipeline.planner.fit.budget import partition_request
    from pipelaunch.pipeline.planner.placement import v_shape
    from pipelaunch.pipeline.planner.schedules import base, build_schedule
    from pipelaunch.pipeline.planner.schedules.zbv import ZBV

    budget._in_flight.cache_clear()  # the order is built here, not taken from an earlier test's counts
    played: list[int] = []
    real = base.simulate_programs
    monkeypatch.setattr(base, "simulate_programs", lambda *a, **k: played.append(1) or real(*a, **k))
    generator = ZBV(fuse_backward=False)
    partition_request(generator, v_shape(4), 16, "none", None, 1e9)
    assert not played
    build_schedule(generator, v_shape(4), 16)
    assert played


def test_milp_keeps_the_models_output_in_the_last_stage():
    """A node the output does not read (an op-level graph's dead-end: here an expensive `side`) may
    go after the output in a topological order; the fastest split then puts the output first
    (bottleneck 10 against 11). The loss is computed on the last stage: milp keeps the output there."""
    g = nx.DiGraph()
    for name, cost in [("x1", 1.0), ("x2", 1.0), ("side", 10.0), ("out", 1.0)]:
        g.add_node(name, forward_s=cost, backward_s=0.0, activation_bytes=0, output_bytes=0, param_bytes=0)
    g.add_edges_from([("x1", "x2"), ("x2", "out"), ("x1", "side")])
    g.graph["outputs"] = ["out"]
    p = milp_partition(g, 2, bandwidth=float("inf"), order=["x1", "x2", "side", "out"])
    assert p.assignment["out"] == 1
