"""Context parallelism (`cp`, #57) on real gloo ranks: every sequence split over cp ranks along its
positions (the head-tail balance), attention over the cp group, the data cut by columns on each
rank, gradients summed over dp x cp. model=gpt (tied and untied) trains like one process running
the same micro-batches whole (losses, step 0's gradients, the final weights within 1e-5)."""

from __future__ import annotations

from collections import Counter

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import FAST, check_like_one_process, compose_cfg

CP = [*FAST, "model.seq_len=8"]


@pytest.mark.timeout(600)
def test_gpt_trains_as_one_process_under_context_parallelism(tmp_path) -> None:
    """pp=2 cp=2 under 1f1b (the ring; tied embeddings, clipping) and ZBV (all-to-all over heads,
    the backward split); pp=1 dp=2 cp=2 (gradients summed over the replicas and their cp ranks),
    and the same at zero=3 (sharded over dp x cp) with every block recomputed (its ring replayed)."""
    cases = [("gpt pp=2 cp=2 1f1b ring", compose_cfg([*CP, "pp=2", "cp=2", "scheduler=1f1b", "+model.tie_embeddings=true",
                                                       "clip_grad_norm=0.05"])),
             ("gpt pp=2 cp=2 zbv alltoall", compose_cfg([*CP, "pp=2", "cp=2", "scheduler=zbv",
                                                          "cp_method=alltoall"])),
             ("gpt pp=1 dp=2 cp=2", compose_cfg([*CP, "pp=1", "dp=2", "cp=2", "scheduler=gpipe"])),
             ("gpt pp=1 dp=2 cp=2 zero=3 remat=full", compose_cfg([*CP, "pp=1", "dp=2", "cp=2", "zero=3", "remat=full",
                                                                   "scheduler=1f1b"]))]
    ranks = check_like_one_process(cases, tmp_path)
    # the collective log: per attention block and micro-batch, cp - 1 = 1 rotation of the keys and
    # values forward, one backward and cp = 2 of their gradients; by all-to-all, q, k, v to
    # positions and the output back (and their reverse backward), the positions gathered once;
    # nothing else on the cp group
    m, blocks = 4, 3  # 6 blocks over 2 stages
    for rank in ranks["gpt pp=2 cp=2 1f1b ring"]:
        log = Counter(e.split(" to ")[0] for e in rank.extras["cp_log"])
        assert log == {"ring kv": m * blocks, "ring kv backward": m * blocks, "ring dkv backward": 2 * m * blocks}, log
    for rank in ranks["gpt pp=2 cp=2 zbv alltoall"]:
        log = Counter(rank.extras["cp_log"])
        assert log == {"allgather positions": m * blocks, "alltoall to positions": 3 * m * blocks + m * blocks,
                       "alltoall to heads": m * blocks + 3 * m * blocks}, log


@pytest.mark.timeout(600)
def test_cp_beside_tensor_parallelism_trains_as_one_process(tmp_path) -> None:
    """pp=1 tp=2 cp=2 with sequence parallelism and the all-to-all: each tp rank's 2 heads over the
    cp group, the tp collectives on the rank's 1/cp of the positions (SP cutting them further)."""
    check_like_one_process([("gpt pp=1 tp=2 cp=2 sp alltoall", compose_cfg(
        [*CP, "pp=1", "tp=2", "cp=2", "sequence_parallel=true", "cp_method=alltoall", "model.heads=4",
         "scheduler=1f1b"]))], tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cp_beside_tp_and_pp_trains_as_one_process(tmp_path) -> None:
    """The issue's slow layout: pp=2 tp=2 cp=2 with sequence parallelism (8 ranks, the ring), and
    transformers' Llama at pp=1 tp=2 cp=2 (its plan splitting heads, the retargeted sdpa)."""
    from tests.test_context_parallel_models import LLAMA

    check_like_one_process([
        ("gpt pp=2 tp=2 cp=2 sp", compose_cfg([*CP, "pp=2", "tp=2", "cp=2", "sequence_parallel=true",
                                                "scheduler=1f1b"])),
        ("llama pp=1 tp=2 cp=2", compose_cfg([*LLAMA, "pp=1", "tp=2", "cp=2", "scheduler=1f1b"]))], tmp_path)


@pytest.mark.timeout(600)
def test_a_mixture_of_experts_trains_as_one_process_under_context_parallelism(tmp_path) -> None:
    """model=gpt's experts beside cp: pp=2 cp=2 with the auxiliary loss (each rank routes 1/cp of a
    micro-batch's tokens: the experts' routed shares are averaged over the cp ranks, and each rank's
    term divided by cp), and pp=1 dp=2 ep=2 cp=2 (the experts' gradients summed over their expert
    replicas and the cp ranks: expert_grad), with DeepSeek-V3's router and bias update on the
    tokens per expert counted over dp x cp."""
    from tests.test_moe import MOE, SIGMOID

    moe = [*MOE, "model.seq_len=8", "scheduler=1f1b"]
    check_like_one_process([
        ("moe pp=2 cp=2 aux loss", compose_cfg([*moe, "pp=2", "cp=2"])),
        ("moe pp=1 dp=2 ep=2 cp=2 sigmoid bias", compose_cfg([*moe, *SIGMOID, "pp=1", "dp=2", "ep=2", "cp=2",
                                                               "moe.bias_update_rate=0.01"]))], tmp_path)


@pytest.mark.timeout(600)
def test_bf16_under_context_parallelism_trains_like_one_process_under_bf16(tmp_path) -> None:
    """precision=bf16 beside cp (the ring's blocks in fp32, its exchanges in bf16): model=gpt at
    pp=2 cp=2 and transformers' Llama at pp=1 dp=2 cp=2 zero=1 against one process's bf16, as
    tests/test_zero_bf16.py holds sharding (losses within 1e-2, step 0's gradients and the final
    weights within 3e-2 of each tensor's norm)."""
    from tests.harness import merge_state, run_jobs
    from tests.reference import reference_run
    from tests.test_context_parallel_models import LLAMA
    from tests.test_zero_bf16 import _relative

    cfgs = {"gpt pp=2 cp=2 bf16": compose_cfg([*CP, "pp=2", "cp=2", "precision=bf16", "steps=2", "scheduler=1f1b"]),
            "llama dp=2 cp=2 zero=1 bf16": compose_cfg([*LLAMA, "pp=1", "dp=2", "cp=2", "zero=1", "precision=bf16",
                                                        "scheduler=1f1b"])}
    for (what, cfg), ranks in zip(cfgs.items(), run_jobs(list(cfgs.values()), tmp_path / "logs"), strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-2), what
        for d in range(cfg.dp):
            for key in ("grads_step0", "params_final"):
                assert _relative(merge_state(ranks, key, d), ref[key]) < 3e-2, (what, key, d)


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["model.seq_len=6", "cp=2"], "cp", "2 x cp = 4 chunks"),
    (["model=mlp", "cp=2"], "cp", "valid: model=gpt"),
    (["cp=2", "cp_method=alltoall", "model.heads=3", "model.dim=48"], "cp_method", "does not divide"),
    (["cp=2", "cp_method=zigzag"], "cp_method", "valid: ring"),
    (["cp=2", "tp=2", "cp_method=alltoall", "model.heads=2"], "cp_method", "a tp rank holds"),
    (["cp=2", "dp=2", "ep=2", "zero=1", "model.experts=4", "model.top_k=2"], "zero", "not supported yet"),
    (["cp=2", "model.experts=4", "model.top_k=2", "moe.capacity_factor=1.25"], "moe.capacity_factor",
     "not supported yet"),
    (["cp=2", "dp=4", "zero=1", "dp_shard=2"], "dp_shard", "not supported yet"),
    (["cp=2", "model.attention=math"], "model.attention", "valid with cp > 1"),
    (["cp=2", "plan=auto", "plan.devices=4", "plan.cp=[1,2]"], "plan.cp", "a search that trains keeps the configured cp=2"),
])
def test_refused_before_spawn(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg([*CP, "pp=1", *overrides]), profile=False)
    assert err.value.key == key and words in str(err.value), str(err.value)


@pytest.mark.timeout(600)
def test_a_cp_checkpoint_resumes_without_cp(tmp_path) -> None:
    """cp changes nothing a checkpoint holds: written at pp=2 cp=2 (SGD with momentum, whose state
    the checkpoint keeps; clipping), it resumes at pp=2 without cp on the uninterrupted run's losses
    and final weights. (Not AdamW here: a key bias's gradient is rounding noise, zero in exact
    arithmetic, which Adam's normalisation turns into steps of the learning rate's size.)"""
    from tests.test_long_runs import check_resumed

    base = [*CP, "optimizer.momentum=0.9", "clip_grad_norm=0.05", "checkpoint.every=2", "steps=4"]
    check_resumed([*base, "pp=2", "cp=2"], [*base, "pp=2"], tmp_path, 2, 4)


@pytest.mark.parametrize("granularity", ["block", "op"])
def test_the_planner_prices_a_ranks_attention_over_the_whole_sequence(granularity: str) -> None:
    """The trace holds one rank's positions; each attention adds cp - 1 times its share of the
    node (all of an attention call; a block's by FLOPs) and its exchanges on the cp link: the ring's
    cp - 1 rotations of keys and values forward, as many and cp fp32 gradient rotations backward."""
    from pipelaunch.models.gpt import gpt
    from pipelaunch.pipeline.planner.measure.context import add_context_costs, attention_share

    spec = gpt(vocab_size=64, dim=32, layers=2, heads=4, seq_len=16, granularity=granularity, context_parallel=2)
    traced = spec.trace(2)
    g = traced.graph
    for n in g.nodes:
        g.nodes[n].update(forward_s=1.0, backward_s=2.0)
    add_context_costs(traced, 2, "ring", (1e-5, 1e9), 4.0)
    priced = {n: g.nodes[n] for n in g.nodes if "cp_exchange_s" in g.nodes[n]}
    assert len(priced) == 2  # one attention per block
    block = 2 * 4 * 8 * 8  # b x heads x local t x head dim
    forward = 1e-5 + 2 * block * 4 / 1e9
    backward = forward + 2 * (1e-5 + 2 * block * 4 / 1e9)
    for name, node in priced.items():
        share = attention_share(traced, name)[0]
        assert (share == 1.0) == (granularity == "op") and 0 < share <= 1
        # a block's: 2 b h t^2 d of attention against 2 b t x its matmul weights (12 d^2), per sample
        assert granularity == "op" or share == pytest.approx(2 * 8 * 8 * 32 / (2 * 8 * 8 * 32 + 2 * 8 * 12 * 32 * 32))
        assert node["cp_exchange_s"] == pytest.approx((forward, backward))
        assert node["forward_s"] == pytest.approx(1.0 + share + forward)
        assert node["backward_s"] == pytest.approx(2.0 + 2 * share + backward)


def test_mode_plan_holds_half_the_activations_at_cp_2() -> None:
    """mode=plan at cp=2: each rank's activations about half of cp=1's (its positions), and the
    plan carries cp."""
    plans = {cp: prepare(compose_cfg([*CP, "model.seq_len=64", "pp=2", f"cp={cp}", "mode=plan"])) for cp in (1, 2)}
    assert plans[2].plan.cp == 2 and plans[2].plan.world_size == 4
    for rank in range(2):
        half = plans[2].prediction.devices[rank].activations / plans[1].prediction.devices[rank].activations
        assert 0.4 < half < 0.6, half
