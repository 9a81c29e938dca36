"""Non-sequential models through the real runtime: long skip connections (unet), a residual CNN
(resnet) and a GPT whose LM head is tied to its embedding, cut by every partitioner at pp 2 and 4.
Loss, every gradient and the weights after 3 steps must equal single-process training."""

from __future__ import annotations

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.models.gpt import SUBLAYER_PARTS
from pipelaunch.pipeline.planner.predict.memory import BudgetExceeded
from tests.harness import assert_state_close, compose_cfg, merge_state, run_jobs
from tests.reference import reference_run

IMAGE = ["data=images", "batch_size=16", "steps=3", "warmup_steps=0", "optimizer=sgd", "timeout_s=60", "threads=1",
         "microbatches=4"]
MODELS = {
    "unet": [*IMAGE, "model=unet", "model.channels=4"],
    "resnet": [*IMAGE, "model=resnet", "model.widths=[8,16]", "model.image_size=16", "model.depth=2"],
    "gpt_tied": ["model.dim=32", "model.layers=6", "model.seq_len=8", "model.vocab_size=64", "+model.tie_embeddings=true",
                 "batch_size=16", "steps=3", "warmup_steps=0", "optimizer=sgd", "timeout_s=60", "threads=1",
                 "microbatches=4"],
}
SPLITS = {  # manual split points (graph node names) per model and pp
    ("unet", 2): "[bottleneck]", ("unet", 4): "[encoders_1,bottleneck,decoders_1]",
    ("resnet", 2): "[layers_1]", ("resnet", 4): "[layers_0,layers_1,layers_2]",
    ("gpt_tied", 2): "[layer3]", ("gpt_tied", 4): "[layer1,layer3,layer5]",
}
PARTITIONERS = ["uniform", "balanced", "milp", "manual"]


def _cfgs(pp: int, partitioners: list[str] = PARTITIONERS) -> list[tuple[str, dict]]:
    out = []
    for model, base in MODELS.items():
        for part in partitioners:
            extra = [f"partitioner.split_points={SPLITS[(model, pp)]}"] if part == "manual" else []
            out.append((f"{model} {part} pp={pp}", compose_cfg([*base, f"partitioner={part}", *extra, f"pp={pp}",
                                                                 "scheduler=1f1b"])))
    return out


#: where balanced cuts diffusers' UNet2DModel follows the profile's timings; on some cuts its
#: group norms and convolutions round otherwise than in one process: every tensor within 1e-5 of
#: it relative to its norm (2.1e-6 at most, measured on a freshly written profile), while an
#: element near zero differs by 8e-9, past the element-wise bound (as tests/test_bring_your_own.py's
#: UNet2DConditionModel)
ROUNDS_OTHERWISE = ("diffusers unet",)


def _assert_all_match_single_process(cases: list[tuple[str, dict]], results: list[list[dict]]) -> None:
    for (what, cfg), ranks in zip(cases, results, strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        exact = not what.startswith(ROUNDS_OTHERWISE)
        assert_state_close(merge_state(ranks, "grads_step0"), ref["grads_step0"], f"{what} grads", exact)
        assert_state_close(merge_state(ranks, "params_final"), ref["params_final"], f"{what} weights", exact)


#: every partitioner cuts every model at pp=2; at pp=4 the default suite runs each model's manual
#: cut (a U-Net skip from stage 0 over two stages to stage 3, the tied GPT's embedding and head on
#: the first and last of four ranks, a ResNet in four), the other partitioners' pp=4 cuts `-m slow`
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("pp", "partitioners"), [
    pytest.param(2, PARTITIONERS, id="2"),
    pytest.param(4, ["manual"], id="4"),
    pytest.param(4, [p for p in PARTITIONERS if p != "manual"], id="4-rest", marks=pytest.mark.slow)])
def test_graph_models_match_single_process(pp: int, partitioners: list[str], tmp_path) -> None:
    cases = _cfgs(pp, partitioners)
    results = run_jobs([cfg for _, cfg in cases], tmp_path / "logs")
    _assert_all_match_single_process(cases, results)


GPT_OP = ["model.dim=32", "model.layers=3", "model.seq_len=8", "model.vocab_size=64", "model.granularity=op",
          "batch_size=16", "steps=3", "warmup_steps=0", "optimizer=sgd", "timeout_s=60", "threads=1", "microbatches=4"]


def _layers_cut(cfg: dict) -> set[str]:
    """Decoder blocks whose operators ended up in more than one stage."""
    stages = prepare(cfg).plan.stages
    owners: dict[str, set[int]] = {}
    for s in stages:
        for node in s.blocks:
            if node.startswith("layer"):
                owners.setdefault(node.split("_")[0], set()).add(s.index)
    return {layer for layer, where in owners.items() if len(where) > 1}


@pytest.mark.timeout(300)
# pp=4 in the slow suite: pp=2 cuts inside blocks under the same three partitioners and schedules
@pytest.mark.parametrize("pp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_operator_level_gpt_cut_inside_blocks(pp: int, tmp_path) -> None:
    """model.granularity=op: stage boundaries fall inside decoder blocks (so several values, the
    residual stream among them, cross one boundary), under split and fused backwards."""
    cases = [(f"gpt op {part} {sched} pp={pp}", compose_cfg([*GPT_OP, f"partitioner={part}", f"scheduler={sched}",
                                                            f"pp={pp}"]))
             for part, sched in (("uniform", "1f1b"), ("balanced", "zbv"), ("milp", "zb_h1"))]
    assert any(_layers_cut(cfg) for _, cfg in cases), "no split fell inside a decoder block"
    results = run_jobs([cfg for _, cfg in cases], tmp_path / "logs")
    _assert_all_match_single_process(cases, results)


@pytest.mark.timeout(300)
def test_sublayer_gpt_cut_between_attention_and_mlp(tmp_path) -> None:
    """model.granularity=sublayer: a cut may fall between a block's attention and MLP halves (the
    residual stream, and a LayerNorm's output when the cut follows it, cross), under split and
    fused backwards."""
    base = [o for o in GPT_OP if not o.startswith("model.granularity")] + ["model.granularity=sublayer"]
    cases = [(f"gpt sublayer {part} {sched} pp={pp}", compose_cfg([*base, f"partitioner={part}", f"scheduler={sched}",
                                                                  f"pp={pp}"]))
             for part, sched, pp in (("balanced", "zbv", 2), ("milp", "1f1b", 2))]
    assert any(_layers_cut(cfg) for _, cfg in cases), "no split fell inside a decoder block"
    for _, cfg in cases:  # attention and MLP stay whole: a block's nodes are its four parts
        for stage in prepare(cfg).plan.stages:
            inner = [n for n in stage.blocks if n.startswith("layer") and n.split("_", 1)[1] not in SUBLAYER_PARTS]
            assert not inner, inner
    results = run_jobs([cfg for _, cfg in cases], tmp_path / "logs")
    _assert_all_match_single_process(cases, results)


def _remat_auto_unet() -> dict:
    """unet at pp=2 under a per-device budget that only its fuller device misses without
    recomputing: that device recomputes chosen modules, keeping their inputs (skip tensors too)."""
    base = [*MODELS["unet"], "scheduler=1f1b", "pp=2", "remat=auto", "memory=budget"]
    peaks = [d.total for d in prepare(compose_cfg([*base, "memory.cap_bytes=1e12"])).prediction.devices]
    with pytest.raises(BudgetExceeded) as refused:  # what recomputing every candidate leaves
        prepare(compose_cfg([*base, "memory.cap_bytes=50.1e6"]))  # just above memory.reserve_bytes
    floor = max(d.total for d in refused.value.prediction.devices)
    # the fuller device misses it without recomputing and meets it recomputing; the other fits as is
    low = max(min(peaks), floor)
    assert low < max(peaks), (peaks, floor)
    cfg = compose_cfg([*base, f"memory.cap_bytes={(low + max(peaks)) / 2}"])
    plan = prepare(cfg).plan
    assert sorted({s.rank for s in plan.stages if s.recompute}) == [peaks.index(max(peaks))]
    return cfg


@pytest.mark.timeout(300)
def test_tied_weights_on_one_rank_and_skips_with_zero_bubble(tmp_path) -> None:
    """V placement puts the tied embedding and head on rank 0 (one shared tensor there), zbv's I/W
    split runs over unet's multi-input stages, and those stages recompute (remat=full, remat=auto)."""
    cases = [
        ("gpt_tied zbv", compose_cfg([*MODELS["gpt_tied"], "scheduler=zbv", "pp=2"])),
        ("unet zbv", compose_cfg([*MODELS["unet"], "scheduler=zbv", "pp=2"])),
        ("unet zb_h1 remat", compose_cfg([*MODELS["unet"], "scheduler=zb_h1", "pp=2", "remat=full"])),
        ("unet 1f1b remat=auto", _remat_auto_unet()),
    ]
    results = run_jobs([cfg for _, cfg in cases], tmp_path / "logs")
    _assert_all_match_single_process(cases, results)


def _ecosystem(factory: str, base: list[str], **model) -> dict:
    cfg = compose_cfg([*base, "batch_size=16", "steps=3", "warmup_steps=0", "optimizer=sgd", "timeout_s=90",
                       "threads=1", "microbatches=4", "pp=2"])
    cfg.model = {"_target_": f"tests.ecosystem_models.{factory}", **model}
    return cfg


@pytest.mark.timeout(400)
def test_models_users_bring_match_single_process(tmp_path) -> None:
    """The two reported bugs (a transformers GPT-2 cut by milp under zbv: a bool attention mask
    crossing ranks; a diffusers UNet2DModel cut by balanced under zbv: torch's CPU group-norm
    weight-only backward on channels-last input), and a model whose blocks have no
    reset_parameters. Each rank materialises only its own stages; no manual seeding anywhere."""
    gpt2 = ["model.vocab_size=64", "model.seq_len=16"]
    unet = ["data=images", "model=unet", "model.image_size=8"]
    cases = [
        ("hf gpt2 milp zbv", _ecosystem("gpt2", [*gpt2, "partitioner=milp", "scheduler=zbv"], vocab_size=64, seq_len=16)),
        ("hf gpt2 uniform 1f1b", _ecosystem("gpt2", [*gpt2, "scheduler=1f1b"], vocab_size=64, seq_len=16)),
        ("diffusers unet balanced zbv", _ecosystem("unet2d", [*unet, "partitioner=balanced", "scheduler=zbv"],
                                                   image_size=8)),
        ("bare params balanced zbv", _ecosystem("bare", ["model.vocab_size=64", "model.seq_len=8", "partitioner=balanced",
                                                         "scheduler=zbv"], vocab_size=64, seq_len=8)),
    ]
    results = run_jobs([cfg for _, cfg in cases], tmp_path / "logs")
    _assert_all_match_single_process(cases, results)
