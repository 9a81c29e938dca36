"""The proof that a pipeline is right: same loss, gradients and weights as single-process training.

Every training schedule of `conf/scheduler/` (tests/schedules.py), with and without full
rematerialisation, for pp in {1, 2, 4} and dp in {1, 2} where the schedule is valid. Real ranks
(gloo on 127.0.0.1, free ports); each spawn runs every config of its world size one after the
other, so the matrix costs four spawns.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from tests.harness import FAST, assert_state_close, compose_cfg, merge_state, run_jobs
from tests.reference import reference_forward, reference_run
from tests.schedules import training_schedules

#: every training option of conf/scheduler/: a schedule added there by YAML is proven here too
TRAINING = list(training_schedules())


#: world 4 in the default suite: every schedule at pp=4 without recomputation (world 2 runs each
#: without it at pp=2; every schedule at pp=2 dp=2, at zero 0-3 with recomputation on every other
#: one, is tests/test_zero.py's default test); the rest is `-m slow`
FIRST_HALF = {(4, 1, "none")}


def _cases(world: int, remats: tuple[str, ...] = ("none", "stage"), half: str = "all") -> list[tuple[dict, str]]:
    out = []
    for sched in TRAINING:
        for pp in (1, 2, 4):
            for dp in (1, 2):
                if pp * dp != world or (pp == 1 and sched not in ("gpipe", "1f1b")):
                    continue
                for remat in remats:
                    if half != "all" and ((pp, dp, remat) in FIRST_HALF) != (half == "first"):
                        continue
                    cfg = compose_cfg([*FAST, f"scheduler={sched}", f"pp={pp}", f"dp={dp}", "microbatches=4",
                                       f"remat={remat}"])
                    try:
                        prepare(cfg)
                    except ConfigError:
                        continue  # not valid for this schedule: covered by the validation tests
                    out.append((cfg, f"{sched} pp={pp} dp={dp} remat={remat}"))
    return out


#: the default suite's worlds: every schedule without recomputation at pp=2 (world 2) and pp=4
#: (world 4); the rest of the matrix is `-m slow`
DEFAULT_WORLDS = [(1, ("none", "stage"), "all"), (2, ("none",), "all"), (4, ("none", "stage"), "first")]
WORLDS = [
    *(pytest.param(*w, id=f"world{w[0]}") for w in DEFAULT_WORLDS),
    pytest.param(2, ("stage",), "all", id="world2-remat", marks=pytest.mark.slow),
    pytest.param(4, ("none", "stage"), "second", id="world4-rest", marks=pytest.mark.slow),
    # every schedule at dp=2 runs in world4 (pp=2 dp=2) and at pp=4 in world4 too; both together
    # (pp=4 dp=2: tests/test_cli.py runs README's zbv command so) are for `-m slow`
    pytest.param(8, ("none",), "all", id="world8", marks=pytest.mark.slow),
    pytest.param(8, ("stage",), "all", id="world8-remat", marks=pytest.mark.slow),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "remats", "half"), WORLDS)
def test_gradients_and_weights_match_single_process(world: int, remats: tuple[str, ...], half: str,
                                                    tmp_path) -> None:
    cases = _cases(world, remats, half)
    assert cases
    results = run_jobs([cfg for cfg, _ in cases], tmp_path / "logs")
    for (cfg, what), ranks in zip(cases, results, strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        assert not any(r.extras["unneeded_imports"] for r in ranks), [r.extras["unneeded_imports"] for r in ranks]
        for d in range(cfg.dp):
            assert_state_close(merge_state(ranks, "grads_step0", d), ref["grads_step0"], f"{what} replica {d} grads")
            assert_state_close(merge_state(ranks, "params_final", d), ref["params_final"], f"{what} replica {d} weights")


@pytest.mark.timeout(300)
# pp=4 in the slow suite: pp=2 runs the same partitioners, and every schedule runs at pp=4 above
@pytest.mark.parametrize("pp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_profiled_partitioners_match_single_process(pp: int, tmp_path) -> None:
    parts = ["partitioner=balanced", "partitioner=milp", "partitioner=manual"]
    splits = {2: "[layer3]", 4: "[layer1,layer3,layer5]"}
    cfgs = []
    for part in parts:
        extra = [f"partitioner.split_points={splits[pp]}"] if part.endswith("manual") else []
        cfgs.append(compose_cfg([*FAST, part, *extra, "scheduler=1f1b", f"pp={pp}", "microbatches=4"]))
    results = run_jobs(cfgs, tmp_path / "logs")
    for part, cfg, ranks in zip(parts, cfgs, results, strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), part
        assert_state_close(merge_state(ranks, "grads_step0"), ref["grads_step0"], f"{part} pp={pp} grads")
        assert_state_close(merge_state(ranks, "params_final"), ref["params_final"], f"{part} pp={pp} weights")


def _remat_auto_cfg(overrides: list[str]) -> tuple[dict, list[int]]:
    """remat=auto under a per-device budget that the fullest devices miss without recomputing and
    every other device meets; also returns those devices (pipeline ranks)."""
    base = [*FAST, *overrides, "microbatches=4", "remat=auto", "memory=budget", "partitioner=uniform"]
    peaks = [d.total for d in prepare(compose_cfg([*base, "memory.cap_bytes=1e12"])).prediction.devices]
    fullest = max(peaks)
    runner_up = max(p for p in peaks if p < fullest)
    cap = (fullest + runner_up) // 2
    return compose_cfg([*base, f"memory.cap_bytes={cap}"]), [r for r, p in enumerate(peaks) if p == fullest]


@pytest.mark.timeout(300)
def test_remat_auto_recomputes_blocks_only_on_the_devices_over_budget_and_matches_single_process(tmp_path) -> None:
    cases = [_remat_auto_cfg(["scheduler=1f1b", "pp=4"]), _remat_auto_cfg(["scheduler=gpipe", "pp=2", "dp=2"])]
    cfgs = [cfg for cfg, _ in cases]
    for cfg, fullest in cases:
        prepared = prepare(cfg)
        plan = prepared.plan
        recomputing = sorted({s.rank for s in plan.stages if s.recompute or s.selective})
        assert recomputing == fullest and len(fullest) < plan.pp  # some devices recompute, not all
        assert plan.schedule.remat_stages() == []  # chosen blocks, not whole stages
        for s in plan.stages:  # not every block of the stage (full or selective): only what closes the gap
            assert len(s.recompute) + len(s.selective) < len(s.blocks), (s.index, s.recompute, s.selective)
        assert prepared.prediction.peak_bytes <= cfg.memory.cap_bytes
        assert plan.meta.stage_recompute_s[plan.stages[0].index] >= 0
    results = run_jobs(cfgs, tmp_path / "logs")
    for cfg, ranks, what in zip(cfgs, results, ["1f1b pp=4 remat=auto", "gpipe pp=2 dp=2 remat=auto"], strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        for d in range(cfg.dp):
            assert_state_close(merge_state(ranks, "grads_step0", d), ref["grads_step0"], f"{what} replica {d} grads")
            assert_state_close(merge_state(ranks, "params_final", d), ref["params_final"], f"{what} replica {d} weights")


def test_every_training_schedule_is_covered() -> None:
    """By the default suite's worlds without recomputation, and with it by tests/test_zero.py's
    pp=2 dp=2 cases (the data-parallel levels in turn; four zero-bubble variants among them in the
    slow suite, `SLOW_SCHEDULES`)."""
    from tests.test_zero import pp2_dp2_cases

    default = [what for world, remats, half in DEFAULT_WORLDS for _, what in _cases(world, remats, half)]
    assert {what.split()[0] for what in default if what.endswith("remat=none")} == set(TRAINING)
    assert {what.split()[0] for _, what in pp2_dp2_cases() if "remat=" in what} == set(TRAINING)


@pytest.mark.timeout(300)
def test_inference_outputs_equal_single_process_forward(tmp_path) -> None:
    cfgs = [compose_cfg([*FAST, "scheduler=inference", f"pp={pp}", "microbatches=4", "steps=2"]) for pp in (2,)]
    results = run_jobs(cfgs, tmp_path / "logs")
    for cfg, ranks in zip(cfgs, results, strict=True):
        holder = next(r for r in ranks if "outputs" in r.extras)
        from hydra.utils import instantiate

        inputs, _ = instantiate(cfg.data).batch(0, cfg.batch_size)
        expected = reference_forward(cfg, inputs)
        torch.testing.assert_close(holder.extras["outputs"], expected, rtol=1e-5, atol=1e-5)
        ref = reference_run(replace(cfg, steps=1), capture_state=False)
        # no optimizer step happens, so step 0's loss is the plain forward loss
        assert ranks[0].losses[0] == pytest.approx(ref["losses"][0], rel=1e-5)


@pytest.mark.timeout(300)
def test_recompute_replays_the_forward_s_dropout(tmp_path) -> None:
    """With dropout, a stage that recomputes its forward (remat=stage: an R action) draws the same
    masks as its first forward did, so its gradients are those of keeping the activations."""
    cases = [(sched, remat) for sched in ("1f1b", "zbv") for remat in ("none", "stage")]
    cfgs = [compose_cfg([*FAST, f"scheduler={sched}", "pp=2", "microbatches=4", f"remat={remat}",
                         "model.dropout=0.2", "partitioner=uniform"]) for sched, remat in cases]
    results = run_jobs(cfgs, tmp_path / "logs")
    by_case = dict(zip(cases, results, strict=True))
    for sched in ("1f1b", "zbv"):
        kept, recomputed = by_case[(sched, "none")], by_case[(sched, "stage")]
        assert recomputed[0].losses == pytest.approx(kept[0].losses, rel=1e-6), sched
        grads_kept, grads_recomputed = merge_state(kept, "grads_step0"), merge_state(recomputed, "grads_step0")
        for name, g in grads_kept.items():
            torch.testing.assert_close(grads_recomputed[name], g, rtol=1e-6, atol=1e-7, msg=f"{sched}: {name}")
    # and dropout really draws: without it the loss differs
    plain = reference_run(compose_cfg([*FAST, "scheduler=1f1b", "pp=2", "microbatches=4"]))
    assert by_case[("1f1b", "none")][0].losses[0] != pytest.approx(plain["losses"][0], rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_v_and_wave_schedules_with_many_micro_batches_match_single_process(tmp_path) -> None:
    """zbv and hanayo at pp=4 with m = 2p: one pair of ranks carries forward messages of one
    stage edge and gradients of another in the same direction, which only the posting order
    tells apart (tags are 0), and the steady state runs long. (The default suite runs both at
    pp=2 with m = 2p, in world2.)"""
    cases = [(sched, compose_cfg([*FAST, f"scheduler={sched}", "pp=4", "microbatches=8", "batch_size=32"]))
             for sched in ("zbv", "hanayo")]
    results = run_jobs([cfg for _, cfg in cases], tmp_path / "logs")
    for (what, cfg), ranks in zip(cases, results, strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        assert_state_close(merge_state(ranks, "grads_step0"), ref["grads_step0"], f"{what} grads")
        assert_state_close(merge_state(ranks, "params_final"), ref["params_final"], f"{what} weights")
