"""A stage's units (pipeline/graph/units.py): the blocks the data-parallel collectives gather,
release and reduce together. The rule on hand-made graphs, the planner's units against the ones a
rank builds for the same stages (the project's GPT, transformers' Llama traced by export at operator
level, a U-Net), and the rewritten stage graph that still computes what it did."""

from __future__ import annotations

import pytest
import torch

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.graph.units import node_param_uses, stage_units, unit_key
from pipelaunch.pipeline.runtime import unit_hooks
from pipelaunch.pipeline.runtime.stage import build_stage_modules, module_units
from tests.harness import FAST, compose_cfg


@pytest.mark.parametrize(("name", "key"), [
    ("model.layers.3.self_attn.q_proj.weight", "model.layers.3"),
    ("transformer.h.0.mlp.c_fc.weight", "transformer.h.0"),
    ("layer3.attn.q.weight", "layer3"),
    ("down_blocks.1.resnets.0.conv1.weight", "down_blocks.1"),
    ("model.layers.2.mlp.experts.7.w1", "model.layers.2"),  # the outermost numbered component
    ("model.embed_tokens.weight", "model.embed_tokens"),
    ("lm_head.weight", "lm_head"),
    ("bias", "bias"),
])
def test_a_parameter_is_keyed_by_its_block_or_its_module(name: str, key: str) -> None:
    assert unit_key(name) == key


def _uses(*nodes: tuple[str, ...]) -> list[tuple[str, set[str]]]:
    return [(f"n{i}", set(params)) for i, params in enumerate(nodes)]


def test_blocks_are_units_and_a_small_module_joins_its_neighbour() -> None:
    """embed (4 MiB), two layers (3 MiB each), a 2 KiB norm and a 4 MiB head: the norm joins the head
    (the neighbour sharing `head` with it), not layer1."""
    mib = 2**20
    uses = _uses(("embed.tokens.weight",), ("layer0.w",), ("layer0.b",), (), ("layer1.w",), ("head.norm.weight",),
                 ("head.proj.weight",))
    sizes = {"embed.tokens.weight": 4 * mib, "layer0.w": 3 * mib, "layer0.b": 1024, "layer1.w": 3 * mib,
             "head.norm.weight": 2048, "head.proj.weight": 4 * mib}
    units = stage_units(uses, sizes)
    assert [u.name for u in units.units] == ["embed.tokens", "layer0", "layer1", "head.norm+head.proj"]
    assert [(u.first, u.last) for u in units.units] == [(0, 0), (1, 2), (4, 4), (5, 6)]
    assert units.units[1].params == ("layer0.b", "layer0.w") and units.root == ()
    assert units.largest == 4 * mib + 2048


def test_a_weight_read_at_both_ends_of_a_stage_goes_to_the_root() -> None:
    """A tied embedding inside one stage (read by the embedding and, under another name, by the head):
    gathering it for one span would hold it through every layer, so the root unit takes it."""
    uses = _uses(("embed.weight",), ("layer0.w",), ("layer1.w",), ("head.weight",))
    units = stage_units(uses, dict.fromkeys(["embed.weight", "layer0.w", "layer1.w"], 1.0),
                        canonical={"head.weight": "embed.weight"})
    assert [u.name for u in units.units] == ["layer0", "layer1"]
    assert units.root == ("embed.weight", "head.weight") and units.root_bytes == 1.0


def test_interleaved_keys_become_one_unit_and_tied_parameters_none() -> None:
    uses = _uses(("a1.w",), ("b1.w",), ("a1.v",), ("b1.v",), ("c1.w", "shared.w"))
    units = stage_units(uses, dict.fromkeys(["a1.w", "a1.v", "b1.w", "b1.v", "c1.w", "shared.w"], 1.0),
                        excluded={"shared.w"})
    assert [u.name for u in units.units] == ["a1+b1", "c1"]
    assert all("shared.w" not in u.params for u in units.units)


CASES = {
    "gpt": [*FAST, "model.layers=4"],
    "gpt tied, sublayer": [*FAST, "model.layers=4", "+model.tie_embeddings=true", "model.granularity=sublayer"],
    "llama (export, operators)": ["model=hf_llama_tiny", "batch_size=4", "microbatches=2", "steps=1"],
    "unet": ["model=unet", "model.channels=4", "data=images", "batch_size=4", "microbatches=2", "steps=1"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_planner_prices_the_units_a_rank_builds(case: str) -> None:
    """For every stage: the plan's units (names and bytes, what the memory model and the collectives'
    pricing read) are those the rank cuts from the stage module it builds, and the rewritten graph
    computes what the stage computed before."""
    cfg = compose_cfg([*CASES[case], "pp=2", "dp=2", "zero=3", "scheduler=1f1b", "mode=plan"])
    prepared = prepare(cfg, profile=False)
    plan, spec = prepared.plan, prepared.spec
    for rank in range(plan.pp):
        modules = build_stage_modules(spec, plan, rank, 0, torch.device("cpu"))
        for s, module in modules.items():
            built = module_units(module, plan)
            planned = plan.meta.stage_units[s]
            assert [u.name for u in built.units] + (["root"] if built.root else []) == [u.name for u in planned], case
            assert [u.nbytes for u in built.units] == [u.param_bytes for u in planned if u.name != "root"], case
            assert built.units, f"{case}: stage {s} has no unit"
    # a rank's rewritten stage computes as before, hooks called in forward order
    modules = build_stage_modules(spec, plan, 0, 0, torch.device("cpu"))
    module = modules[0]
    inputs = spec.example_batch(plan.micro_batch_size)[0]
    kw = {name: inputs for name, producer in plan.stages[0].inputs.items() if producer is None}
    before = module(**kw)
    calls: list[tuple[str, int]] = []

    class Record:
        def forward_begin(self, u: int) -> None:
            calls.append(("begin", u))

        def forward_end(self, u: int) -> None:
            calls.append(("end", u))

        backward_begin = backward_end = forward_end

    units = module_units(module, plan)
    unit_hooks.install(module.gm, units, Record())
    after = module(**kw)
    for name in before:
        torch.testing.assert_close(after[name], before[name])
    assert calls == [(w, u) for u in range(len(units.units)) for w in ("begin", "end")]
    assert node_param_uses(module.gm)  # still readable after the rewrite


def test_buckets_fill_to_ddp_s_size_at_zero0_and_blocks_stay_units_above() -> None:
    """Left null, dp_bucket_bytes is DDP's 25 MB at zero=0 (a small model's stage is one bucket) and
    one unit per block at zero >= 1; 0 asks for one per block, a number for that size at any level."""
    from pipelaunch.pipeline.planner.build import bucket_bytes

    assert bucket_bytes(None, 0) == 25e6 and bucket_bytes(None, 3) is None and bucket_bytes(0, 0) is None
    assert bucket_bytes(1e6, 2) == 1e6
    base = [*FAST, "model.layers=4", "pp=2", "dp=2", "scheduler=1f1b", "mode=plan"]
    plans = {args: prepare(compose_cfg([*base, *args]), profile=False).plan
             for args in (("zero=0",), ("zero=0", "dp_bucket_bytes=0"), ("zero=1",), ("zero=1", "dp_bucket_bytes=1e9"))}
    assert [len(u) for u in plans[("zero=0",)].meta.stage_units] == [1, 1]
    assert all(len(u) >= 2 for u in plans[("zero=0", "dp_bucket_bytes=0")].meta.stage_units)
    assert all(len(u) >= 2 for u in plans[("zero=1",)].meta.stage_units)
    assert [len(u) for u in plans[("zero=1", "dp_bucket_bytes=1e9")].meta.stage_units] == [1, 1]
