"""zero >= 1 with 1 < ep < dp (#56): each rank's experts sharded by FSDP2 over their dp / ep expert
replicas (the `expert_dp` group: a mesh of their own), gathered, released and reduced with the
unit that holds them, the other parameters over all dp replicas as before. Trains like one process
running the same micro-batches, issues the experts' collectives on the expert replicas only, and
its checkpoints resume under other layouts."""

from __future__ import annotations

import pytest

from tests.harness import FAST, assert_no_process_left, check_like_one_process, compose_cfg, job_processes
from tests.test_moe import MOE

#: pp=1 dp=4 ep=2: two ep groups of two, each expert on two expert replicas (sharded over them)
DP4_EP2 = [*MOE, "pp=1", "dp=4", "ep=2", "scheduler=gpipe", "microbatches=2"]


def _expert_lines(log: list[str]) -> list[str]:
    """The collective log's lines of the experts' own groups (`0:layer1/layer1.mlp.experts ...`)."""
    return [line for line in log if "/" in line.split()[0]]


@pytest.mark.timeout(300)
def test_experts_sharded_over_their_expert_replicas_train_as_one_process(tmp_path) -> None:
    """zero=1 (gathered at the stage's first compute, reduce-scattered in its last backward) and
    zero=3 (per unit, released after use): the losses, step 0's gradients and the final weights of
    every replica within 1e-5 of one process. The log shows each MoE layer's experts gathered and
    reduced as a group of their own, of the rank's experts' size (half of them at ep=2), in the
    same order on every replica (the run's order check passed)."""
    cases = [("ep=2 dp=4 zero=1", compose_cfg([*DP4_EP2, "zero=1"])),
             ("ep=2 dp=4 zero=3", compose_cfg([*DP4_EP2, "zero=3"]))]
    ranks = check_like_one_process(cases, tmp_path)
    cfg = cases[0][1]
    experts, width, dim = cfg.model["experts"], cfg.model["expert_dim"], cfg.model["dim"]
    moe_layers = cfg.model["layers"] - cfg.model["dense_layers"]
    for what, results in ranks.items():
        log = results[0].extras["collective_log"]
        lines = _expert_lines(log)
        assert {line.split()[0].split("/")[1] for line in lines} == {
            f"layer{i}.mlp.experts" for i in range(cfg.model["dense_layers"], cfg.model["layers"])}, what
        held = experts // 2 * 3 * width * dim  # the rank's 2 experts: gate_up (2 x width x dim) and down
        assert {int(line.split()[2]) for line in lines} == {held}, what
        gathers = sum(" all_gather " in line for line in lines)
        reduces = sum(" reduce_scatter " in line for line in lines)
        per_step = what.endswith("zero=1")  # else once per micro-batch's F and B (zero=3, 2 micro-batches)
        assert reduces == (moe_layers if per_step else 2 * moe_layers), what
        assert gathers == (moe_layers if per_step else 2 * 2 * moe_layers), what
        assert all(r.extras["collective_log"] == log for r in results), what


@pytest.mark.slow  # 8 ranks
@pytest.mark.timeout(600)
def test_experts_sharded_over_expert_replicas_at_pp2_zero2_train_as_one_process(tmp_path) -> None:
    """pp=2 dp=4 ep=2 zero=2 under 1f1b and DualPipeV (its split backward: the experts' gradients
    reduce-scattered in the W that completes them)."""
    base = [*MOE, "pp=2", "dp=4", "ep=2", "zero=2", "microbatches=4"]
    check_like_one_process([("ep=2 pp=2 dp=4 zero=2 1f1b", compose_cfg([*base, "scheduler=1f1b"])),
                            ("ep=2 pp=2 dp=4 zero=2 dualpipev", compose_cfg([*base, "scheduler=dualpipev"]))],
                           tmp_path)


@pytest.mark.slow  # model=gpt's experts run this path by default (above)
@pytest.mark.timeout(900)
def test_transformers_and_user_experts_sharded_over_expert_replicas_train_as_one_process(tmp_path) -> None:
    """The other experts modules `expert_holders` wraps: transformers' stacked ones (Mixtral) and a
    user's list (model=module, its `LocalExperts`), at pp=1 dp=4 ep=2 zero=1 and zero=3."""
    from tests.test_hf_moe import COMMON as HF
    from tests.test_user_moe import COMMON as USER

    pp1 = ["pp=1", "dp=4", "ep=2", "scheduler=gpipe"]
    cases = [(f"{what} ep=2 dp=4 zero={z}", compose_cfg([*common, *pp1, f"zero={z}"]))
             for what, common in (("mixtral", [*HF, "model=hf_mixtral_tiny"]), ("user", USER)) for z in (1, 3)]
    ranks = check_like_one_process(cases, tmp_path)
    for what, results in ranks.items():
        assert _expert_lines(results[0].extras["collective_log"]), what


@pytest.mark.timeout(600)
@pytest.mark.parametrize("resumed", [("ep4", ["pp=1", "dp=4", "ep=4", "zero=1"]),
                                     pytest.param(("pp2", ["pp=2", "dp=4", "ep=1", "zero=0"]),
                                                  marks=pytest.mark.slow)],
                         ids=["ep4", "pp2"])
def test_a_checkpoint_of_sharded_experts_resumes_under_other_layouts(resumed, tmp_path) -> None:
    """dp=4 ep=2 zero=1 (AdamW, cosine, clipping that bites: the experts' sharded squares summed
    over their expert replicas) checkpointed at step 3 holds every expert whole and resumes at
    dp=4 ep=4 (each rank's experts whole, unsharded) and, in the slow suite, at pp=2 dp=4 without
    ep, on the uninterrupted run's losses and weights within 1e-5."""
    from tests.test_long_runs import RESUME, check_resumed

    before = job_processes()
    moe = [o for o in MOE[len(FAST):] if o.startswith("model.")]
    base = [*RESUME, *moe, "checkpoint.every=3", "steps=6", "microbatches=2", "scheduler=gpipe"]
    ref = check_resumed([*base, "pp=1", "dp=4", "ep=2", "zero=1"], [*base, *resumed[1]], tmp_path, 3, 6)
    assert ref["layer1.mlp.experts.gate_up_proj"].shape[0] == 4  # every expert, whole
    assert_no_process_left(before)  # both runs' launchers and ranks are gone
