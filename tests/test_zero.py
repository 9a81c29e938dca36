"""Sharded data parallel (`zero=1|2|3`) trains like one process: every training schedule at pp=2
dp=2, with tied weights kept whole, clipping over sharded gradients, full recomputation and a
U-Net's skips, on real gloo ranks in NCCL-semantics mode (tags 0, every pair's posting order
checked). The matrix (every schedule at every level, pp=4 dp=2 too) is `-m slow`; the
cross-layout resume through zero=3 is in tests/test_long_runs.py."""

from __future__ import annotations

import pytest

from tests.harness import FAST, assert_state_close, compose_cfg, merge_state, run_jobs
from tests.reference import reference_run
from tests.schedules import training_schedules

TRAINING = list(training_schedules())
#: tied input and output embeddings (kept whole on every replica), clipping that bites
TIED = [*FAST, "+model.tie_embeddings=true", "clip_grad_norm=0.05", "microbatches=4"]
UNET = ["data=images", "batch_size=16", "steps=3", "warmup_steps=0", "optimizer=sgd", "timeout_s=60", "threads=1",
        "microbatches=4", "model=unet", "model.channels=4"]


def _check(cases: list[tuple[list[str], str]], log_dir) -> None:
    cfgs = [compose_cfg(args) for args, _ in cases]
    results = run_jobs(cfgs, log_dir)
    for cfg, (_, what), ranks in zip(cfgs, cases, results, strict=True):
        ref = reference_run(cfg)
        assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
        for d in range(cfg.dp):
            assert_state_close(merge_state(ranks, "grads_step0", d), ref["grads_step0"], f"{what} replica {d} grads")
            assert_state_close(merge_state(ranks, "params_final", d), ref["params_final"], f"{what} replica {d} weights")


def pp2_dp2_cases() -> list[tuple[list[str], str]]:
    """Every training schedule at pp=2 dp=2 recomputing, each at one level, the levels 0-3 in turn
    (each on three or more schedules; zero=0 is the replicated data parallel), whole stages
    (remat=stage, R actions) and every block (remat=full) in turn, each level meeting both; without
    recomputation every schedule runs at pp=2 and pp=4 in tests/test_equivalence.py."""
    return [([*TIED, f"scheduler={sched}", "pp=2", "dp=2", f"zero={i % 4}", f"remat={_remat(i)}"],
             f"{sched} zero={i % 4} remat={_remat(i)}") for i, sched in enumerate(TRAINING)]


#: in the slow suite with sharding and recomputation (below): zero-bubble variants whose I/W split
#: interleaved_zb, zbv and dualpipev run here by default at zero 0, 1 and 1 (each schedule runs
#: without recomputation at pp=2 and pp=4 by default: tests/test_equivalence.py)
SLOW_SCHEDULES = ("v_half", "v_min", "zb_h1", "zb_h2")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero_bubble_variants_at_pp2_dp2_train_like_one_process_under_sharding(tmp_path) -> None:
    _check([c for c in pp2_dp2_cases() if c[1].split()[0] in SLOW_SCHEDULES], tmp_path / "logs")


def _remat(i: int) -> str:
    return ("stage", "full")[(i // 4) % 2]


@pytest.mark.timeout(600)
def test_every_schedule_at_pp2_dp2_trains_like_one_process_under_sharding(tmp_path) -> None:
    """Every schedule recomputing at one level (`pp2_dp2_cases`); hybrid sharding (dp=4 in two
    groups of 2); and a U-Net's skips at zero=3."""
    cases = [c for c in pp2_dp2_cases() if c[1].split()[0] not in SLOW_SCHEDULES]
    # hybrid sharding: groups of 2 replicas shard, the 2 groups replicate (HSDP)
    cases += [([*TIED, f"scheduler={sched}", "pp=1", "dp=4", "dp_shard=2", f"zero={zero}"],
               f"{sched} pp=1 dp=4 dp_shard=2 zero={zero}") for sched, zero in (("1f1b", 3),)]
    cases += [([*UNET, "scheduler=zbv", "pp=2", "dp=2", "zero=3"], "unet zbv zero=3")]
    assert {w for _, what in cases for w in what.split() if w.startswith("zero=")} == {"zero=0", "zero=1", "zero=2", "zero=3"}
    _check(cases, tmp_path / "logs")


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_at_every_level_trains_like_one_process(pp: int, tmp_path) -> None:
    # at pp=4 the schedules that need m >= 2p (DualPipeV: 8) get 8 micro-batches, as at dp=1 (test_equivalence)
    shape = [] if pp == 2 else ["microbatches=8", "batch_size=32"]
    base = [a for a in TIED if not (shape and a.startswith("microbatches="))] + shape
    cases = [([*base, f"scheduler={sched}", f"pp={pp}", "dp=2", f"zero={zero}"], f"{sched} pp={pp} zero={zero}")
             for sched in TRAINING for zero in (1, 2, 3)]
    _check(cases, tmp_path / "logs")
