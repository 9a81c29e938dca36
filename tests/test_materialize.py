"""Initialisation by name (init.weights=by_name): the same weights whatever the split. Each stage
materialised on its own, from a fresh meta model, holds exactly the tensors the single-process
reference holds under the same names, and nothing of the other stages."""

from __future__ import annotations

import pytest
import torch

from pipelaunch.models.gpt import gpt
from pipelaunch.models.unet import unet
from pipelaunch.pipeline.graph.init import FALLBACK_STD, uncovered_tensors
from pipelaunch.pipeline.graph.materialize import materialize
from pipelaunch.pipeline.graph.split import split_model
from pipelaunch.pipeline.planner.partition import uniform
from pipelaunch.pipeline.runtime.stage import meta_tensor_names
from tests.ecosystem_models import bare, gpt2

SPECS = {
    "gpt": lambda: gpt(vocab_size=64, dim=32, layers=4, heads=4, seq_len=8),
    "gpt_tied": lambda: gpt(vocab_size=64, dim=32, layers=4, heads=4, seq_len=8, tie_embeddings=True),
    "gpt_op": lambda: gpt(vocab_size=64, dim=32, layers=2, heads=4, seq_len=8, granularity="op"),
    "unet": lambda: unet(channels=4),
    "bare": bare,
    "hf_gpt2": gpt2,
}


def _real_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("stages", [2, 3])
def test_every_stage_built_alone_equals_the_reference(name: str, stages: int) -> None:
    spec = SPECS[name]()
    reference = spec.build_full(seed=7, by_name=True)
    ref = {n: t for n, t in [*reference.named_parameters(remove_duplicate=False),
                             *reference.named_buffers(remove_duplicate=False)]}
    assignment = uniform(spec.trace(2).graph, stages).assignment
    for s in range(stages):
        model = spec.build_meta()
        traced = spec.trace(2, model)
        stage = split_model(traced, assignment, stages).stages[s]
        names = meta_tensor_names(stage)
        materialize(model, 7, torch.device("cpu"), spec.init, names={traced.param_aliases.get(n, n) for n in names},
                    also=[stage])
        held = dict([*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)])
        assert held, f"stage {s} holds no tensor"
        for n, t in held.items():
            assert t.device.type == "cpu", n
            torch.testing.assert_close(t, ref[n], rtol=0, atol=0, msg=f"{name} stage {s}: {n}")
        # the rank holds its stage's tensors and nothing else (a tie shared with another stage aside)
        assert _real_bytes(model) == _real_bytes(stage)


def test_ties_survive_materialisation_and_the_launcher_holds_no_weights() -> None:
    spec = SPECS["gpt_tied"]()
    model = spec.build_full(0, by_name=True)
    assert model.head.proj.weight is model.embed.tokens.weight
    traced = spec.trace(2)
    assert _real_bytes(traced.gm) == 0  # traced on the meta device


def test_documented_fallback_for_tensors_no_initialiser_writes() -> None:
    spec = bare(dim=64)
    assert uncovered_tensors(spec.build_meta()) == [f"mix{i}.{n}" for i in range(4) for n in ("mix", "scale", "offset")]
    model = spec.build_full(0, by_name=True)
    assert torch.equal(model.mix0.scale, torch.ones(64)) and torch.equal(model.mix0.offset, torch.zeros(64))
    assert float(model.mix0.mix.detach().std()) == pytest.approx(FALLBACK_STD, rel=0.1)
    assert not torch.equal(model.mix0.mix, model.mix1.mix)  # seeded by name: each its own draw
    assert not torch.equal(spec.build_full(1, by_name=True).mix0.mix, model.mix0.mix)


def test_transformers_initialiser_is_used_where_the_model_has_one() -> None:
    """GPT-2's Conv1D has no reset_parameters: its weights come from transformers' _init_weights
    (N(0, 0.02), c_proj rescaled by 1/sqrt(2 * layers)), seeded by name."""
    spec = gpt2(dim=256, layers=8)
    assert uncovered_tensors(spec.build_meta(), spec.init) == []
    model = spec.build_full(0, by_name=True)
    block = model.model.transformer.h[0]
    assert float(block.attn.c_attn.weight.detach().std()) == pytest.approx(0.02, rel=0.05)
    assert float(block.attn.c_proj.weight.detach().std()) == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(block.ln_1.weight, torch.ones(256))
