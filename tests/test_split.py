"""Stage building: running the stages in sequence reproduces the full model, values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipelaunch.models.gpt import gpt
from pipelaunch.models.resnet import resnet
from pipelaunch.models.unet import unet
from pipelaunch.pipeline.graph.init import init_by_name
from pipelaunch.pipeline.graph.split import split_model
from pipelaunch.pipeline.graph.trace import trace_model
from pipelaunch.pipeline.planner.partition import balanced, milp_partition, uniform
from pipelaunch.pipeline.planner.partition.common import assignment_from_order, topo_order
from tests.stages import run_stages


def summed_stage_grads(split, stages) -> dict[str, torch.Tensor]:
    """Each parameter's gradient summed over every stage holding a copy (tied weights)."""
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            canon = split.canonical(name)
            grads[canon] = grads[canon] + p.grad if canon in grads else p.grad.clone()
    return grads


def check_equivalence(model: nn.Module, split, x: torch.Tensor, loss_fn, target: torch.Tensor) -> None:
    stages = [copy.deepcopy(s) for s in split.stages]  # one independent copy per "rank"
    out = run_stages(split, x, stages=stages)
    ref = model(x)
    assert torch.equal(out, ref)
    loss_fn(out, target).backward()
    loss_fn(ref, target).backward()
    grads = summed_stage_grads(split, stages)
    full = dict(model.named_parameters())
    assert set(grads) == set(full)
    for name, p in full.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_unet_skips_across_stages() -> None:
    spec = unet()
    model = spec.build_full(0)
    x, y = spec.example_batch(2)
    traced = trace_model(model, x)  # fine-grained: every conv, norm and cat is a node
    part = uniform(traced.graph, 4)
    split = split_model(traced, part.assignment, 4)
    jumps = [c - io.index for io in split.io for cons in io.outputs.values() for c in cons]
    assert max(jumps) >= 3  # a value from stage 0 read directly in stage 3
    for io in split.io:
        for name, src in io.inputs.items():
            assert src is None or io.index in split.io[src].outputs[name]
    assert split.model_outputs == {traced.graph.graph["outputs"][0]: 3}
    assert split.shared_params == {}
    check_equivalence(model, split, x, spec.loss_fn, y)


def test_stage_modules_hold_only_their_own_params_under_full_names() -> None:
    spec = unet()
    model = spec.build_full(0, by_name=True)  # initialised by name: what the stages below repeat alone
    x, _ = spec.example_batch(2)
    traced = trace_model(model, x, spec.leaf_modules)
    split = split_model(traced, balanced(traced.graph, 3).assignment, 3)
    names = [set(io.params) for io in split.io]
    assert set().union(*names) == {n for n, _ in model.named_parameters()}
    assert sum(len(n) for n in names) == len(list(model.parameters()))  # disjoint
    full = model.state_dict()
    for s, stage in enumerate(split.stages):
        fresh = copy.deepcopy(stage)
        init_by_name(fresh, seed=0)  # a rank building only this stage gets the same weights
        for name, t in fresh.state_dict().items():
            assert torch.equal(t, full[name]), (s, name)


def test_gpt_tied_embedding_and_head() -> None:
    model = gpt(layers=2, dim=32, heads=2, seq_len=16, vocab_size=64).build_full(0)
    model.head.proj.weight = model.embed.tokens.weight
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    traced = trace_model(model, x)
    part = uniform(traced.graph, 4)  # unprofiled: equal node counts put embed and head far apart
    split = split_model(traced, part.assignment, 4)
    assert split.shared_params == {"embed.tokens.weight": [0, 3]}
    assert "head.proj.weight" in split.io[3].params

    def loss(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, 64), t.reshape(-1))

    check_equivalence(model, split, x, loss, target)


def test_resnet_split_by_milp() -> None:
    spec = resnet()
    model = spec.build_full(0)
    x, y = spec.example_batch(2)
    traced = trace_model(model, x)
    for v in traced.graph.nodes:  # unprofiled graph: price nodes by output size instead
        traced.graph.nodes[v]["forward_s"] = 1e-9 * traced.graph.nodes[v]["output_bytes"] + 1e-6
    part = milp_partition(traced.graph, 3, time_limit=5)
    split = split_model(traced, part.assignment, 3)
    check_equivalence(model, split, x, spec.loss_fn, y)


def test_exported_model_splits() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 1:  # forces the torch.export fallback
                return self.b(torch.relu(self.a(x)) + x)
            return x

    model = Branchy()
    x = torch.randn(4, 8)
    traced = trace_model(model, x)
    assert traced.method == "export"
    order = topo_order(traced.graph)
    split = split_model(traced, assignment_from_order(order, [0, len(order) // 2]), 2)
    check_equivalence(model, split, x, lambda o, t: (o - t).pow(2).mean(), torch.zeros(4, 8))


def test_incomplete_assignment_rejected() -> None:
    model = gpt(layers=1).build_full(0)
    traced = trace_model(model, torch.zeros(1, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="misses"):
        split_model(traced, {}, 2)
