"""Operator-level graphs hold values that are not tensors (shape ints, tuples). No stage boundary may
fall on an edge out of one: the contraction keeps each with its consumers, and every partitioner's
split of an operator-level GPT is then one the splitter can build and that computes the same thing."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from pipelaunch.launcher.plugins import build_plugin
from pipelaunch.models.gpt import gpt
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.split import split_model
from pipelaunch.pipeline.graph.trace import trace_model
from pipelaunch.pipeline.planner.build import partition_graph
from pipelaunch.pipeline.planner.partition import PartitionRequest, validate_assignment
from pipelaunch.pipeline.planner.partition.atomic import contract_unsendable, sends_as_tensor
from tests.test_split import check_equivalence

SPEC = gpt(vocab_size=64, dim=32, layers=3, heads=4, seq_len=8, granularity="op")


def _traced():
    return trace_model(SPEC.build_full(0), SPEC.example_batch(2)[0], SPEC.leaf_modules)


def test_operator_level_gpt_has_unsendable_values_that_stay_inside_units() -> None:
    traced = _traced()
    g = traced.graph
    unsendable = [n for n in g.nodes if not sends_as_tensor(g, n) and g.out_degree(n)]
    assert unsendable, "b, t, d = x.shape should give shape-integer nodes"
    contraction = contract_unsendable(g)
    assert contraction is not None
    assert nx.is_directed_acyclic_graph(contraction.graph)
    unit_of = {m: u for u, ms in contraction.members.items() for m in ms}
    assert sorted(unit_of) == sorted(g.nodes)
    for n in unsendable:
        assert all(unit_of[s] == unit_of[n] for s in g.successors(n)), n
    # costs are conserved
    total = sum(g.nodes[n].get("forward_s", 0.0) for n in g.nodes)
    assert sum(contraction.graph.nodes[u]["forward_s"] for u in contraction.graph.nodes) == pytest.approx(total)


def test_graph_of_tensors_only_is_left_alone() -> None:
    g = nx.DiGraph([("a", "b"), ("b", "c")])
    assert contract_unsendable(g) is None


@pytest.mark.parametrize("name", ["uniform", "balanced", "milp"])
@pytest.mark.parametrize("stages", [2, 4, 7])
def test_every_partitioner_cuts_only_tensor_edges_and_the_split_is_exact(name: str, stages: int) -> None:
    traced = _traced()
    partitioner = build_plugin("partitioner", {"_target_": f"pipelaunch.pipeline.planner.partition.plugins.{name}_split"})
    part = partition_graph(partitioner, traced.graph, list(range(stages)), PartitionRequest(1e9, [stages - s for s in range(stages)]))
    validate_assignment(traced.graph, part.assignment, stages)
    for u, v in traced.graph.edges:
        if part.assignment[u] != part.assignment[v]:
            assert sends_as_tensor(traced.graph, u), f"{u} -> {v} crosses stages"
    split = split_model(traced, part.assignment, stages)
    x, target = SPEC.example_batch(2, seed=1)
    torch.manual_seed(0)
    check_equivalence(traced.gm, split, x, SPEC.loss_fn, target)


def test_unknown_granularity_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="model.granularity.*block, sublayer, op"):
        gpt(granularity="layer")
