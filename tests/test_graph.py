"""Tracing and profiling: graphs, shapes, tied weights, fallbacks, the profile cache."""

from __future__ import annotations

import itertools
import json
import time

import networkx as nx
import pytest
import torch
from torch import nn

from pipelaunch.models.gpt import DecoderBlock, LMHead, gpt
from pipelaunch.models.resnet import resnet
from pipelaunch.models.spec import causal_lm_loss
from pipelaunch.models.unet import unet
from pipelaunch.pipeline.compute.backward import backward_input, backward_weight
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.trace import TraceError, trace_model
from pipelaunch.pipeline.planner.measure.profile import (
    PASSES,
    CacheEvictor,
    ProfileJob,
    last_level_cache_bytes,
    measure_op,
    profile_graph,
    profile_graphs,
)
from pipelaunch.pipeline.planner.partition import (
    balanced,
    manual,
    milp_partition,
    uniform,
    validate_assignment,
)


def tied_gpt(layers: int = 2) -> tuple[nn.Module, torch.Tensor]:
    """A gpt whose LM head reuses the token embedding matrix."""
    model = gpt(layers=layers, dim=32, heads=2, seq_len=16, vocab_size=64).build_full(0)
    model.head.proj.weight = model.embed.tokens.weight
    return model, torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def test_trace_gpt_fine_and_blocks() -> None:
    model = gpt(layers=2, dim=32, heads=2, seq_len=16, vocab_size=64).build_full(0)
    x = torch.randint(0, 64, (2, 16))
    fine = trace_model(model, x)
    assert nx.is_directed_acyclic_graph(fine.graph)
    assert fine.method == "fx" and fine.input_names == ["input"]
    assert fine.graph.nodes["embed_tokens"]["module"] == "embed.tokens"
    assert fine.graph.nodes["embed_tokens"]["params"] == ["embed.tokens.weight"]
    head = fine.graph.graph["outputs"][0]
    assert fine.graph.nodes[head]["shape"] == [[2, 16, 64], "float32"]
    assert fine.graph.nodes[head]["output_bytes"] == 2 * 16 * 64 * 4
    coarse = trace_model(model, x, leaf_modules=["embed", "layer0", "layer1", "head"])
    assert list(coarse.graph.nodes) == ["embed", "layer0", "layer1", "head"]
    assert coarse.graph.number_of_edges() == 3


def test_bad_leaf_name() -> None:
    model = gpt(layers=1).build_full(0)
    with pytest.raises(ConfigError, match="leaf_modules"):
        trace_model(model, torch.zeros(1, 32, dtype=torch.long), leaf_modules=["nope"])


def test_tied_weight_used_by_two_nodes() -> None:
    model, x = tied_gpt()
    traced = trace_model(model, x)
    users = [n for n, d in traced.graph.nodes(data=True) if "embed.tokens.weight" in d["params"]]
    assert users == ["embed_tokens", "head_proj"]
    assert traced.param_aliases == {"head.proj.weight": "embed.tokens.weight"}


@pytest.mark.parametrize("spec", [unet(), resnet()], ids=["unet", "resnet"])
def test_trace_graph_models(spec) -> None:
    model = spec.build_full(0)
    x, _ = spec.example_batch(2)
    fine = trace_model(model, x)
    coarse = trace_model(model, x, spec.leaf_modules)
    assert fine.graph.number_of_nodes() > coarse.graph.number_of_nodes() >= len(spec.leaf_modules)
    assert nx.is_directed_acyclic_graph(coarse.graph)
    if spec.name == "unet":  # long skip: first encoder feeds the last concat
        assert any(v.startswith("cat") for v in coarse.graph.successors("encoders_0"))


class ShapeBranch(nn.Module):
    """Python control flow on a shape: fx cannot trace it, torch.export specialises it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            return self.lin(x).relu() * 2
        return self.lin(x)


class DataBranch(nn.Module):
    """Control flow on tensor values: neither tracer can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return x


def test_export_fallback() -> None:
    model, x = ShapeBranch(), torch.randn(3, 4)
    traced = trace_model(model, x)
    assert traced.method == "export"
    assert all(d["op"] == "call_function" for _, d in traced.graph.nodes(data=True))
    assert any("lin.weight" in d["params"] for _, d in traced.graph.nodes(data=True))


def test_untraceable_model_points_to_manual() -> None:
    with pytest.raises(TraceError, match="partitioner=manual") as info:
        trace_model(DataBranch(), torch.randn(3, 4))
    assert "DataBranch" in str(info.value) and "the model's own forward" in str(info.value)


def test_untraceable_submodule_is_named_with_its_operation_and_the_leaf_fix_works() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), DataBranch()), nn.Linear(4, 4))
    with pytest.raises(TraceError) as info:
        trace_model(model, torch.randn(3, 4))
    message = str(info.value)
    assert "submodule '1.1'" in message and "if x.sum() > 0" in message and "DataBranch.forward" in message
    assert "model.leaf_modules=[1.1]" in message and "partitioner=manual" in message
    traced = trace_model(model, torch.randn(3, 4), leaf_modules=["1.1"])
    assert traced.method == "fx"


def test_profile_fields(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIPELAUNCH_CACHE", str(tmp_path))
    spec = unet()
    model = spec.build_full(0)
    x, _ = spec.example_batch(2)
    traced = trace_model(model, x, spec.leaf_modules)
    config = {"name": "unet", "channels": 8}
    profile_graph(traced, x, repeats=2, model_config=config)
    assert traced.graph.graph["profile_cached"] is False
    for name, d in traced.graph.nodes(data=True):
        assert d["forward_s"] > 0 and d["output_bytes"] > 0, name
        if d["params"]:
            assert d["backward_s"] > 0 and d["param_bytes"] > 0 and d["activation_bytes"] > 0, name
    assert traced.graph.nodes["encoders_0"]["param_bytes"] == sum(
        p.numel() * 4 for p in model.encoders[0].parameters()
    )
    first = {n: dict(d) for n, d in traced.graph.nodes(data=True)}
    again = trace_model(model, x, spec.leaf_modules)
    profile_graph(again, x, repeats=2, model_config=config)
    assert again.graph.graph["profile_cached"] is True
    assert {n: d["forward_s"] for n, d in again.graph.nodes(data=True)} == {
        n: d["forward_s"] for n, d in first.items()
    }
    other = trace_model(model, x, spec.leaf_modules)
    profile_graph(other, x, repeats=1, model_config={**config, "channels": 16})
    assert other.graph.graph["profile_cached"] is False
    assert len(list(tmp_path.glob("*.json"))) == 2


#: calls of `_Bursty.forward` so far, across the copies the profiler makes of it
_BURST_CALLS = [0]


class _Bursty(nn.Module):
    """A linear layer that runs 30 ms slow on its 2nd-5th calls: a burst of machine noise that
    lasts longer than the repeats of one node."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _BURST_CALLS[0] += 1
        if 2 <= _BURST_CALLS[0] <= 5:
            time.sleep(0.03)
        return self.lin(x)


def test_a_burst_of_noise_hits_one_pass_not_the_profile() -> None:
    """Timed back to back, five repeats of a node all fall in the burst and it is measured 30 ms
    slow; spread over passes through the graph, the burst takes one pass's repeats and the median
    over the passes leaves it out."""
    model = nn.Sequential(_Bursty(), nn.ReLU())
    x = torch.randn(4, 8)
    traced = trace_model(model, x, ["0"])
    _BURST_CALLS[0] = 0
    profile_graph(traced, (x,), repeats=6)
    assert _BURST_CALLS[0] > 6  # the burst was spent inside the profile
    assert traced.graph.nodes["_0"]["forward_s"] < 0.01


class _IndexedBlock(nn.Module):
    """A block that keeps its index, as transformers' decoder layers keep `layer_idx`; the first
    copy runs 30 ms slow in every pass, as the first blocks of a profile measured dear."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 0:
            time.sleep(0.03)
        return torch.relu(self.lin(x))


class _KindBlock(nn.Module):
    """A block whose work depends on a plain setting its repr does not show."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "slow":
            time.sleep(0.02)
        return self.lin(x)


def test_copies_of_one_block_share_one_timing_and_different_blocks_keep_their_own() -> None:
    """Five copies of a block pool their samples: the copy that measured slow in every pass gets
    the copies' median, and all five the same figures (a balanced split cannot tell them apart,
    so it cannot change between profiles). Blocks that differ, in a setting (`kind`) or in their
    weights' shapes, are timed apart."""
    x = torch.randn(4, 8)
    copies = nn.Sequential(*[_IndexedBlock(i) for i in range(5)])
    traced = trace_model(copies, x, [str(i) for i in range(5)])
    profile_graph(traced, (x,), repeats=3)
    forward = {n: traced.graph.nodes[f"_{n}"]["forward_s"] for n in range(5)}
    backward = {n: traced.graph.nodes[f"_{n}"]["backward_s"] for n in range(5)}
    assert len(set(forward.values())) == 1 and len(set(backward.values())) == 1, (forward, backward)
    assert forward[0] < 0.01

    mixed = nn.Sequential(_KindBlock("slow"), _KindBlock("fast"), _KindBlock("fast"), nn.Linear(8, 16))
    traced = trace_model(mixed, x, ["0", "1", "2", "3"])
    profile_graph(traced, (x,), repeats=3)
    times = {n: traced.graph.nodes[n]["forward_s"] for n in ("_0", "_1", "_2", "_3")}
    assert times["_0"] > 0.015 and times["_1"] < 0.01, times
    assert times["_1"] == times["_2"] != times["_3"], times


#: the tags of `_Tagged` blocks in the order their copies ran
_RAN: list[str] = []


class _Tagged(nn.Module):
    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _RAN.append(self.tag)
        return self.lin(x)


def test_graphs_profiled_together_share_every_pass() -> None:
    """plan=auto's micro-batch sizes are measured in shared passes: the first pass runs over every
    graph before the second starts, so a slow minute lands on every size alike instead of making
    the size profiled in it look dear."""
    x = torch.randn(4, 8)
    jobs = [ProfileJob(trace_model(nn.Sequential(_Tagged(tag)), x, ["0"]), (x,)) for tag in ("a", "b")]
    _RAN.clear()
    profile_graphs(jobs, repeats=3)
    assert [tag for tag, _ in itertools.groupby(_RAN)] == ["a", "b"] * PASSES
    assert all(job.traced.graph.nodes["_0"]["forward_s"] > 0 for job in jobs)


class _CountingEvictor(CacheEvictor):
    """Counts evictions instead of writing a cache-sized buffer."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_the_cache_is_evicted_before_each_timed_run_of_an_op_worth_it() -> None:
    """An op that takes milliseconds is timed cold (the cache written over before each timed
    forward and backward), as it runs inside a pipeline; one that takes microseconds is not, since
    the write would cost more than the cache could change."""
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def slow(t: torch.Tensor) -> torch.Tensor:
        time.sleep(2 * CacheEvictor.min_s)
        return lin(t)

    for fn, per_repeat in ((slow, 2), (lin, 0)):
        evict = _CountingEvictor()
        measure_op(fn, (x,), {}, list(lin.parameters()), torch.device("cpu"), 4, evict=evict)
        assert evict.calls == 4 * per_repeat, fn
    assert last_level_cache_bytes(torch.device("cpu")) >= 2**20


def test_chain_traced_on_meta_and_profiled_leaf_by_leaf_works_with_every_partitioner(tmp_path, monkeypatch) -> None:
    """A chain of blocks is a graph whose leaves are its blocks: traced on the meta device (no
    weights), profiled one materialised block at a time, the loss charged to the head."""
    monkeypatch.setenv("PIPELAUNCH_CACHE", str(tmp_path))
    spec = gpt(layers=4, dim=32, heads=2, seq_len=16, vocab_size=64)
    traced = trace_model(spec.build_meta(), spec.meta_input(2), spec.leaf_modules)
    assert all(p.device.type == "meta" for p in traced.gm.parameters())
    g = traced.graph
    assert list(g.nodes) == ["embed", "layer0", "layer1", "layer2", "layer3", "head"]
    x, y = spec.example_batch(2)
    profile_graph(traced, (x,), repeats=2, model_config={"test": "chain"}, loss=(spec.loss_fn, y))
    for name, d in g.nodes(data=True):
        assert d["forward_s"] > 0 and d["backward_s"] > 0 and d["param_bytes"] > 0, name
        assert d["activation_bytes"] > 0 and d["output_bytes"] > 0, name
    assert all(p.device.type == "meta" for p in traced.gm.parameters())  # profiling materialised copies only
    again = trace_model(spec.build_meta(), spec.meta_input(2), spec.leaf_modules)
    profile_graph(again, (x,), repeats=2, model_config={"test": "chain"}, loss=(spec.loss_fn, y))
    assert again.graph.graph["profile_cached"] is True
    for part in (
        uniform(g, 3),
        balanced(g, 3),
        milp_partition(g, 3, time_limit=5),
        manual(g, 3, ["layer1", "layer3"]),
    ):
        validate_assignment(g, part.assignment, 3)
        assert part.bottleneck_s >= part.lower_bound_s * (1 - 1e-9)


def test_split_backward_passes_the_gradient_of_an_output_that_is_an_input() -> None:
    """A stage output that is one of its inputs (a `.to()` to its own dtype returns it): the
    I/W split gives it the gradient one backward gives (GPT-2 under zbv sent zeros before)."""

    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    y = lin(x)
    passed = x.to(torch.float32)
    assert passed is x
    gy, gx = torch.randn(3, 4), torch.randn(3, 4)
    grads, stash = backward_input([y, passed], [gy, gx], {"x": x}, list(lin.parameters()))
    backward_weight(stash)
    torch.testing.assert_close(grads["x"], gy @ lin.weight + gx)
    torch.testing.assert_close(lin.weight.grad, gy.T @ x.detach())


def test_profiled_weight_stash_is_what_the_split_backward_keeps(tmp_path, monkeypatch) -> None:
    """Per node, the profile records the gradients the runtime's I keeps for W; summed over a
    stage's nodes they are what a split backward of the whole stage keeps."""
    monkeypatch.setenv("PIPELAUNCH_CACHE", str(tmp_path))
    torch.manual_seed(0)
    lin = nn.Linear(8, 16)
    x = torch.randn(4, 8)
    assert measure_op(lin, (x,), {}, list(lin.parameters()), torch.device("cpu"), 1)["stash_bytes"] == 4 * 16 * 4
    assert measure_op(nn.GELU(), (x,), {}, [], torch.device("cpu"), 1)["stash_bytes"] == 0
    emb = nn.Embedding(10, 8)  # no differentiable input: W runs from the output's gradient
    tokens = torch.randint(0, 10, (4, 3))
    assert measure_op(emb, (tokens,), {}, list(emb.parameters()), torch.device("cpu"), 1)["stash_bytes"] == 4 * 3 * 8 * 4

    stage = nn.Sequential(DecoderBlock(32, 4), DecoderBlock(32, 4), nn.LayerNorm(32), nn.Linear(32, 64))
    h = torch.randn(2, 16, 32)
    traced = trace_model(stage, h, ("0", "1"))
    profile_graph(traced, h, repeats=1, model_config={"test": "stash"})
    profiled = sum(d["stash_bytes"] for _, d in traced.graph.nodes(data=True))
    leaf = h.clone().requires_grad_(True)
    out = stage(leaf)
    _, stash = backward_input([out], [torch.ones_like(out)], {"h": leaf}, list(stage.parameters()))
    kept = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for _, grads, _ in stash.restarts for g in grads}
    assert profiled == sum(kept.values()) > 0
    backward_weight(stash)

    stale = {"nodes": {n: {k: v for k, v in d.items() if k in ("forward_s", "backward_s", "activation_bytes",
                                                                  "output_bytes", "param_bytes")}
                       for n, d in traced.graph.nodes(data=True)}}
    for path in tmp_path.glob("*.json"):  # a profile cached before stash_bytes existed is measured again
        path.write_text(json.dumps(stale))
    again = trace_model(stage, h, ("0", "1"))
    profile_graph(again, h, repeats=1, model_config={"test": "stash"})
    assert again.graph.graph["profile_cached"] is False
    assert sum(d["stash_bytes"] for _, d in again.graph.nodes(data=True)) == profiled


def _net_allocated(fn):
    """Bytes `fn` leaves allocated (its result kept alive), from the profiler's memory records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = fn()
    return sum(e.self_cpu_memory_usage for e in prof.events()), kept


def test_profiled_bytes_are_what_a_last_stage_holds_after_its_forward_and_its_input_gradient(tmp_path, monkeypatch) -> None:
    """The simulator's accounting of a split backward, checked against the allocator: after F the
    stage holds its saved tensors and its output; after I it has let go of the output and the
    loss's saved tensors (above the nodes W restarts from) and holds the gradients W restarts from."""
    monkeypatch.setenv("PIPELAUNCH_CACHE", str(tmp_path))
    torch.manual_seed(0)
    stage = nn.Sequential(DecoderBlock(64, 4), DecoderBlock(64, 4), LMHead(64, 512))
    h, target = torch.randn(4, 32, 64), torch.randint(0, 512, (4, 32))
    traced = trace_model(stage, h, ("0", "1"))
    profile_graph(traced, h, repeats=1, model_config={"test": "held"}, loss=(causal_lm_loss, target))
    total = {k: sum(d[k] for _, d in traced.graph.nodes(data=True))
             for k in ("activation_bytes", "stash_bytes", "loss_activation_bytes")}
    logits, leaf = 4 * 32 * 512 * 4, h.numel() * 4
    params = list(stage.parameters())

    def forward():
        x = h.clone().requires_grad_(True)
        out = stage(x)
        return x, out, causal_lm_loss(out, target)

    def forward_and_input_grad():
        x, out, loss = forward()
        grads, stash = backward_input([loss], [None], {"x": x}, params)
        return x, grads, stash

    forward(), forward_and_input_grad()  # warm up: lazily created buffers are not the stage's
    after_f, _ = _net_allocated(forward)
    after_i, (_, _, stash) = _net_allocated(forward_and_input_grad)
    backward_weight(stash)
    assert after_f == pytest.approx(leaf + total["activation_bytes"] + logits, rel=0.05)
    assert after_i == pytest.approx(leaf + total["activation_bytes"] - total["loss_activation_bytes"]
                                    + total["stash_bytes"] + leaf, rel=0.05)  # + the input's gradient
