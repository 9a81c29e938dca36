"""DeepSeek-V3's auxiliary-loss-free load balancing (`moe.bias_update_rate`): after each optimizer
step every expert's routing correction bias moves by the rate toward an even load over the step's
global batch (models/moe.py `update_bias`), on every rank holding the layer as in one process, and
checkpoints carry the bias."""

from __future__ import annotations

import pytest
import torch

from pipelaunch.launcher.export import model_tensors
from pipelaunch.launcher.plugins import build_plugins
from pipelaunch.launcher.validate import prepare
from pipelaunch.models.moe import MoE, Router, update_bias
from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import FAST, check_like_one_process, compose_cfg, merge_state, run_jobs
from tests.test_moe import MOE, SIGMOID

RATE = "moe.bias_update_rate=0.01"


def test_an_overloaded_expert_goes_down_and_an_underloaded_one_up() -> None:
    """The rule: -rate above the mean tokens per expert, +rate below, nothing at it; and a
    one-process loop calls it with the layer's own counts, which then pick differently."""
    router = Router(8, 4, 2, "sigmoid")
    update_bias(router, torch.tensor([10, 2, 6, 6]), 0.01)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]), rtol=0, atol=1e-7)
    update_bias(router, torch.tensor([1.0, 1.0, 7.0, 3.0]), 0.5)  # mean 3: two below, one above
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.49, 0.51, -0.5, 0.0]), rtol=0, atol=1e-7)

    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 2, router="sigmoid", bias_update_rate=0.1)
    x = torch.randn(4, 16, 8)
    moe(x)
    counts = moe.counts.clone()
    update_bias(moe.router, moe.counts, moe.bias_update_rate)
    busiest, idlest = int(counts.argmax()), int(counts.argmin())
    assert moe.router.expert_bias[busiest] < 0 < moe.router.expert_bias[idlest]
    moe.counts = None
    moe(x)
    assert moe.counts[busiest] <= counts[busiest] and moe.counts[idlest] >= counts[idlest]
    assert "router.expert_bias" in moe.state_dict()  # a persistent buffer: checkpoints carry it


def test_the_key_reaches_model_gpts_sigmoid_routers() -> None:
    """moe.bias_update_rate sets every MoE layer's rate (null and 0: none)."""
    for value, want in (("0.01", 0.01), ("0", None), ("null", None)):
        spec = build_plugins(compose_cfg([*MOE, *SIGMOID, f"moe.bias_update_rate={value}"])).model.build()
        layers = [m for m in spec.build_meta().modules() if isinstance(m, MoE)]
        assert layers and all(m.bias_update_rate == want for m in layers), value
        assert spec.meta["bias_update_rate"] == want


@pytest.mark.timeout(600)
def test_the_bias_moves_as_in_one_process_and_resumes_exactly(tmp_path) -> None:
    """pp=2 dp=2 ep=2 under DualPipeV with the sigmoid router at moe.bias_update_rate=0.01: losses,
    gradients and weights as one process applying the same update after each step; the final
    checkpoint's biases are the reference's, the first step's moved off zero; a run resumed from step 2 follows
    the uninterrupted one to the bit, bias included."""
    from tests.reference import reference_run

    base = [*MOE, *SIGMOID, RATE, "model.layers=4", "pp=2", "dp=2", "ep=2", "scheduler=dualpipev", "steps=4",
            "checkpoint.every=1", "checkpoint.keep=0"]
    cfg = compose_cfg([*base, f"checkpoint.dir={tmp_path / 'straight'}"])
    straight = check_like_one_process([("bias update ep=2 dualpipev", cfg)], tmp_path / "one")
    ranks = straight["bias update ep=2 dualpipev"]
    final = model_tensors(tmp_path / "straight" / "step_0000004")
    biases = {n: t for n, t in final.items() if n.endswith("router.expert_bias")}
    ref = reference_run(cfg)["buffers_final"]
    assert set(biases) == {n for n in ref if n.endswith("router.expert_bias")} and len(biases) == 3
    for name, bias in biases.items():
        torch.testing.assert_close(bias, ref[name], rtol=0, atol=1e-7, msg=name)
        moves = bias / 0.01  # four updates, each of one rate up or down (or none at the mean): net
        torch.testing.assert_close(moves, moves.round(), rtol=0, atol=1e-4, msg=name)
        assert moves.abs().max() <= 4, name
    # it moved: after the first step every layer's bias is +-rate (0 only for an expert exactly at the mean)
    first = model_tensors(tmp_path / "straight" / "step_0000001")
    for name in biases:
        assert first[name].abs().max() > 0, name
        torch.testing.assert_close(first[name], torch.sign(first[name]) * 0.01, rtol=0, atol=1e-9, msg=name)

    resumed_cfg = compose_cfg([*base, f"resume={tmp_path / 'straight' / 'step_0000002'}",
                               f"checkpoint.dir={tmp_path / 'resumed'}"])
    resumed = run_jobs([resumed_cfg], tmp_path / "two")[0]
    assert resumed[0].losses[-2:] == ranks[0].losses[-2:]
    again = model_tensors(tmp_path / "resumed" / "step_0000004")
    assert set(again) == set(final) and all(torch.equal(again[k], final[k]) for k in final)
    for d in range(2):
        got, want = merge_state(resumed, "params_final", d), merge_state(ranks, "params_final", d)
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.timeout(600)
def test_transformers_deepseek_v3_moves_its_gates_bias_as_in_one_process(tmp_path) -> None:
    """transformers' DeepSeek-V3 at pp=2 dp=2 ep=2 (DualPipeV): each gate's e_score_correction_bias,
    which its top-k reads, moves after every step by the global counts, as one process moving it by
    the same rule: losses, gradients and weights match, and the checkpoint's biases are the
    reference's, off zero."""
    from tests.reference import reference_run
    from tests.test_hf_moe import COMMON, PP2, _exchanged

    cfg = compose_cfg([*COMMON, "model=hf_deepseek_v3_tiny", *PP2, "scheduler=dualpipev", "microbatches=4",
                       "batch_size=16", RATE, "steps=3",
                       "checkpoint.every=3", f"checkpoint.dir={tmp_path / 'ck'}"])
    ranks = check_like_one_process([("deepseek_v3 bias update", cfg)], tmp_path / "logs")
    _exchanged(ranks["deepseek_v3 bias update"], 3, 4)  # its 3 MoE layers' tokens carried each micro-batch
    saved = {n: t for n, t in model_tensors(tmp_path / "ck" / "step_0000003").items()
             if n.endswith("gate.e_score_correction_bias")}
    ref = reference_run(cfg)["buffers_final"]
    assert len(saved) == 3 and set(saved) == {n for n in ref if n.endswith("gate.e_score_correction_bias")}
    for name, bias in saved.items():
        torch.testing.assert_close(bias, ref[name], rtol=0, atol=1e-7, msg=name)
        assert bias.abs().max() > 0, name


@pytest.mark.parametrize(("overrides", "words"), [
    ([*MOE, RATE], "model.router=softmax picks its experts without a correction bias"),
    ([*FAST, RATE], "has no routers with a correction bias"),
    ([*MOE, *SIGMOID, "moe.bias_update_rate=-0.001"], "got -0.001"),
    ([*MOE, *SIGMOID, "moe.bias_update_rate=nan"], "got nan"),
    (["data=synthetic", "batch_size=8", "microbatches=2", "model=hf_mixtral_tiny", "model.seq_len=16", RATE],
     "gates (mixtral) pick their experts without a correction bias"),
])
def test_refused_before_spawn(overrides: list[str], words: str) -> None:
    """A bad rate, a router without a correction bias, a model without routers, transformers'
    DeepSeek-V3 (whose gate's bias the runtime does not move): refused naming the key and what fits."""
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg(overrides), profile=False)
    assert err.value.key == "moe.bias_update_rate" and words in str(err.value), str(err.value)
    assert ("model.router=sigmoid" in str(err.value)) == ("got" not in words), str(err.value)
