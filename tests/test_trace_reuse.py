"""Planning a large model traces it as few times as it can (issue #45): the launcher's tp check
reads the export traces planning made instead of exporting the model again, exports skip the
per-node Python stack traces nothing reads, and work repeated over one graph (the units a cut
keeps whole, the planner's stage modules' code, the pooled timings of a layer's copies) is done
once, each giving what the work done afresh gives."""

from __future__ import annotations

import copy
import random
import statistics

import networkx as nx
import pytest
import torch

import pipelaunch.launcher.validate as validate
import pipelaunch.pipeline.graph.trace as trace_module
from pipelaunch.launcher.tensor_parallel import check_tensor_parallel
from pipelaunch.models.gpt import gpt
from pipelaunch.pipeline.graph.derived import sent_bytes
from pipelaunch.pipeline.graph.split import split_model
from pipelaunch.pipeline.graph.trace import trace_model
from pipelaunch.pipeline.planner.measure.profile import MIN_TIME_S, TIMES, _pool_copies
from pipelaunch.pipeline.planner.partition.atomic import contract_unsendable
from pipelaunch.pipeline.planner.partition.common import assignment_from_order, topo_order
from tests.harness import compose_cfg

LLAMA = ["model=hf_llama_tiny", "model.seq_len=16", "batch_size=8", "microbatches=2", "threads=1"]


@pytest.fixture
def exports(monkeypatch) -> list[int]:
    """Counts torch.export traces: one entry per export."""
    made: list[int] = []
    real = trace_module._export_trace

    def counted(module, args):
        made.append(1)
        return real(module, args)

    monkeypatch.setattr(trace_module, "_export_trace", counted)
    return made


def test_the_tp_check_reads_the_export_traces_planning_made(monkeypatch, exports) -> None:
    """tp=2 on transformers' Llama (an export trace): planning traces the model at one tp rank's
    shapes; the launcher's check then cuts and rewrites that very trace, and exports nothing more
    (its reshape check runs the model eagerly on meta: no mask helper reads values there since
    transformers builds no causal mask for sdpa, models/hf.py `causal_without_mask`). Given no
    traces (a plan checked on its own) it exports the local model again."""
    during_check: list[int] = []
    real_check = validate.check_tensor_parallel

    def check(spec, plan, traces=None):
        before = len(exports)
        real_check(spec, plan, traces)
        during_check.append(len(exports) - before)

    monkeypatch.setattr(validate, "check_tensor_parallel", check)
    prepared = validate.prepare(compose_cfg([*LLAMA, "pp=2", "tp=2"]), profile=False)
    assert prepared.plan.tp == 2
    assert exports, "transformers' Llama is traced by torch.export"
    assert during_check == [0]
    before = len(exports)
    check_tensor_parallel(prepared.spec, prepared.plan)  # no traces given: traced afresh
    assert len(exports) - before == 1


def test_an_export_trace_without_stack_traces_is_the_same_graph(monkeypatch) -> None:
    """The graph exported without per-node stack traces has the nodes, targets and shapes of the
    one exported with them, and the switch is put back afterwards."""
    from pipelaunch.launcher.validate import build_plugins

    spec = build_plugins(compose_cfg(LLAMA)).model.build()
    fast = spec.trace(2, spec.build_meta())
    assert fast.method == "export"
    assert torch.fx.config.do_not_emit_stack_traces is False
    assert not any(n.meta.get("stack_trace") for n in fast.gm.graph.nodes)
    monkeypatch.setattr(trace_module, "_no_stack_traces", lambda: __import__("contextlib").nullcontext())
    slow = spec.trace(2, spec.build_meta())
    assert any(n.meta.get("stack_trace") for n in slow.gm.graph.nodes), "the switch is what drops them"

    def nodes(traced):
        return [(n.name, n.op, str(n.target), tuple(getattr(n.meta.get("tensor_meta"), "shape", ()) or ()))
                for n in traced.gm.graph.nodes]

    assert nodes(fast) == nodes(slow)
    assert dict(fast.graph.nodes(data=True)) == dict(slow.graph.nodes(data=True))
    assert list(fast.graph.edges) == list(slow.graph.edges)


def _op_gpt():
    spec = gpt(vocab_size=64, dim=32, layers=3, heads=4, seq_len=8, granularity="op")
    return spec, trace_model(spec.build_full(0), spec.example_batch(2)[0], spec.leaf_modules)


def _contracted(graph: nx.DiGraph) -> tuple[dict, dict, list]:
    c = contract_unsendable(graph)
    assert c is not None
    return c.members, dict(c.graph.nodes(data=True)), sorted(c.graph.edges(data=True))


def test_a_unit_carries_its_members_costs_and_what_leaves_it() -> None:
    """Each unit's costs are its members' (summed in program order), its output the bytes of the
    members another unit reads, and an edge between units carries the last such edge's bytes."""
    _, traced = _op_gpt()
    g = traced.graph
    for i, n in enumerate(topo_order(g)):  # costs of their own on every node
        g.nodes[n].update(forward_s=0.1 + i / 7, backward_s=0.3 + i / 11, activation_bytes=i)
    c = contract_unsendable(g)
    unit_of = {m: u for u, ms in c.members.items() for m in ms}
    for u, ms in c.members.items():
        assert c.graph.nodes[u]["forward_s"] == sum(float(g.nodes[m]["forward_s"]) for m in ms)
        assert c.graph.nodes[u]["activation_bytes"] == sum(g.nodes[m]["activation_bytes"] for m in ms)
        out = [m for m in ms if any(unit_of[s] != u for s in g.successors(m))]
        assert c.graph.nodes[u]["output_bytes"] == sum(sent_bytes(g.nodes[m]) for m in out)
    carried = {}
    for a, b in g.edges:
        if unit_of[a] != unit_of[b]:
            carried[(unit_of[a], unit_of[b])] = g.edges[a, b].get("bytes", 0)
    assert {(a, b): d["bytes"] for a, b, d in c.graph.edges(data=True)} == carried


def test_the_units_of_a_graph_are_found_again_when_the_graph_changes() -> None:
    """A graph cut again gives the contraction a fresh copy of it gives, unchanged, after its costs
    change, after a node becomes unsendable and after an edge is added."""
    _, traced = _op_gpt()
    g = traced.graph
    assert _contracted(g) == _contracted(copy.deepcopy(g))
    assert _contracted(g) == _contracted(copy.deepcopy(g))  # the second cut of the same graph
    first = next(n for n in topo_order(g) if g.nodes[n].get("forward_s") is None)
    g.nodes[first]["forward_s"] = 1.5
    assert _contracted(g) == _contracted(copy.deepcopy(g))
    members = _contracted(g)[0]
    unit_of = {m: u for u, ms in members.items() for m in ms}
    boundary = [n for n in topo_order(g) if any(unit_of[s] != unit_of[n] for s in g.successors(n))]
    g.nodes[boundary[len(boundary) // 2]]["single_tensor"] = False  # now kept with its consumers
    assert _contracted(g) == _contracted(copy.deepcopy(g))
    assert _contracted(g)[0] != members
    members = _contracted(g)[0]
    order = topo_order(g)
    g.add_edge(order[1], order[-2])  # the closure now spans the model
    assert _contracted(g) == _contracted(copy.deepcopy(g))
    assert _contracted(g)[0] != members


def test_lazy_stage_modules_are_the_stage_modules() -> None:
    """The planner's stages (code generated only when read or run) have the eager stages' code,
    parameters and outputs."""
    spec, traced = _op_gpt()
    order = topo_order(traced.graph)
    assignment = assignment_from_order(order, [0, len(order) // 3, 2 * len(order) // 3])
    eager, lazy = split_model(traced, assignment, 3), split_model(traced, assignment, 3, lazy=True)
    assert [io.__dict__ for io in eager.io] == [io.__dict__ for io in lazy.io]
    x = spec.example_batch(2)[0]
    env_eager, env_lazy = {eager.input_names[0]: x}, {lazy.input_names[0]: x}
    for a, b, io in zip(eager.stages, lazy.stages, eager.io, strict=True):
        assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
        out_a, out_b = a(**{n: env_eager[n] for n in io.inputs}), b(**{n: env_lazy[n] for n in io.inputs})
        assert a.code == b.code
        env_eager.update(out_a)
        env_lazy.update(out_b)
    for name in eager.model_outputs:
        assert torch.equal(env_eager[name], env_lazy[name])


def test_copies_timings_are_pooled_as_each_node_pooling_its_own() -> None:
    """The pooled medians taken once per group of copies are each node's medians over its group's
    samples, as taken node by node."""
    rng = random.Random(0)
    names = [f"n{i}" for i in range(30)]
    signatures = {n: f"s{i % 4}" for i, n in enumerate(names[:-1])}  # the last has no signature (the loss)

    def result(name: str) -> dict:
        samples = {k: [rng.random() for _ in range(rng.randint(0, 3))] for k in TIMES}
        return {"activation_bytes": rng.randint(0, 100), "samples": samples, "name": name}

    runs = [{n: result(n) for n in names} for _ in range(3)]
    got = _pool_copies(runs, signatures)
    for name in names:
        group = [m for m in names if m in signatures and signatures[m] == signatures.get(name)] \
            if name in signatures else [name]
        pooled = {k: [t for r in runs for m in group for t in r[m]["samples"][k]] for k in TIMES}
        want = {**{k: v for k, v in runs[0][name].items() if k != "samples"},
                **{k: max(statistics.median(v), MIN_TIME_S) if v else 0.0 for k, v in pooled.items()}}
        assert got[name] == want
