"""Sharding one block at a time inside a stage, on real gloo ranks in NCCL-semantics mode: every
level trains like one process, the collectives each rank issued are per block (counted from its
recorded log, which the replicas' order check also reads), and the measured peak falls with the
level as the memory model predicts."""

from __future__ import annotations

from collections import Counter

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, Kind
from tests.harness import FAST, assert_state_close, compose_cfg, merge_state, run_jobs
from tests.reference import reference_run

#: pp=2 dp=2 on the V (rank 1 holds stages 1 and 2, each receiving an input), 4 micro-batches
BASE = [*FAST, "model.layers=8", "pp=2", "dp=2", "scheduler=zbv", "microbatches=4", "batch_size=16"]
CASES = {"zero=0": ["zero=0", "dp_bucket_bytes=0"], "zero=1": ["zero=1"], "zero=2": ["zero=2"], "zero=3 use": ["zero=3"],
         "zero=3 run": ["zero=3", "reshard=run"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfgs = {what: compose_cfg([*BASE, *args]) for what, args in CASES.items()}
    results = run_jobs(list(cfgs.values()), tmp_path_factory.mktemp("logs"))
    return {what: (cfg, ranks) for (what, cfg), ranks in zip(cfgs.items(), results, strict=True)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("what", list(CASES))
def test_every_level_and_release_point_trains_like_one_process(runs, what: str) -> None:
    cfg, ranks = runs[what]
    ref = reference_run(cfg)
    assert ranks[0].losses == pytest.approx(ref["losses"], rel=1e-5), what
    for d in range(cfg.dp):
        assert_state_close(merge_state(ranks, "grads_step0", d), ref["grads_step0"], f"{what} replica {d} grads")
        assert_state_close(merge_state(ranks, "params_final", d), ref["params_final"], f"{what} replica {d} weights")


def _counts(ranks, pp_rank: int, dp_rank: int) -> Counter:
    """(stage, unit, collective) -> how many times the rank issued it in its first step."""
    rank = next(r for r in ranks if (r.rank_info.pp_rank, r.rank_info.dp_rank) == (pp_rank, dp_rank))
    log = rank.extras["collective_log"]
    out: Counter = Counter()
    for line in log:
        where, what, *_ = line.split()
        stage, unit = where.split(":", 1)
        out[(int(stage), unit, what)] += 1
    return out


@pytest.mark.timeout(600)
def test_the_collectives_are_per_block(runs) -> None:
    """Rank 1 (stages 1 and 2, every block a unit): zero=3 with reshard=use gathers each block once
    per compute action of its stage (F, I, W, B) and reduce-scatters it once per micro-batch; with
    reshard=run once per run of the stage's actions (its UNSHARDs); zero=2 gathers each once a step
    and reduce-scatters it per micro-batch; zero=1 once each; zero=0 all-reduces each block once.
    Both replicas issued the same (the run's order check passed)."""
    for what, (cfg, ranks) in runs.items():
        plan = prepare(cfg, profile=False).plan
        acts = [Action.parse(a) for a in next(r for r in ranks if r.rank_info.pp_rank == 1).extras["program"]]
        counts = _counts(ranks, 1, 0)
        assert counts == _counts(ranks, 1, 1), what
        for s in (1, 2):
            units = [u.name for u in plan.meta.stage_units[s]]
            computes = sum(a.stage == s and a.is_compute for a in acts)
            runs_of = sum(a.stage == s and a.kind is Kind.UNSHARD for a in acts)
            expected = {
                "zero=0": {"all_reduce": 1},
                "zero=1": {"all_gather": 1, "reduce_scatter": 1},
                "zero=2": {"all_gather": 1, "reduce_scatter": cfg.microbatches},
                "zero=3 use": {"all_gather": computes, "reduce_scatter": cfg.microbatches},
                "zero=3 run": {"all_gather": runs_of, "reduce_scatter": cfg.microbatches},
            }[what]
            assert len(units) >= 2, (what, s, units)
            for u in units:
                got = {k: counts[(s, u, k)] for k in ("all_gather", "reduce_scatter", "all_reduce")
                       if counts[(s, u, k)]}
                assert got == expected, (what, s, u, got)


def test_reshard_run_is_refused_below_zero3() -> None:
    with pytest.raises(ConfigError, match="reshard") as err:
        prepare(compose_cfg([*BASE, "zero=2", "reshard=run", "mode=plan"]), profile=False)
    assert "set zero=3, or leave reshard=use" in str(err.value)
    with pytest.raises(ConfigError, match="reshard"):
        compose_cfg([*BASE, "zero=3", "reshard=later"])
