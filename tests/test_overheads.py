"""The runtime's fixed costs: measured once by two real probe ranks, cached, and priced."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.planner.measure.overheads import cache_path, cached_overheads
from pipelaunch.pipeline.planner.predict.prediction import predict
from tests.harness import FAST, assert_no_process_left, compose_cfg, job_processes


@pytest.mark.timeout(240)
def test_overheads_are_measured_once_by_two_ranks_and_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIPELAUNCH_CACHE", str(tmp_path))
    before = job_processes()
    measured = cached_overheads(1)
    assert measured is not None
    assert 0 < measured.latency_s < 0.1 and 0 < measured.action_s < 0.1
    assert cache_path(1).is_file()
    assert cached_overheads(1) == measured  # read back, not measured again
    assert_no_process_left(before)


def test_configured_overheads_win_and_reach_the_plan() -> None:
    plan = prepare(compose_cfg([*FAST, "pp=2", "mode=plan", "link_latency_s=0.002", "action_overhead_s=0.0005"])).plan
    assert plan.meta.machine.link_latency_s == 0.002 and plan.meta.machine.action_overhead_s == 0.0005


def test_every_compute_action_pays_the_fixed_cost() -> None:
    cfg = compose_cfg([*FAST, "pp=2", "scheduler=1f1b", "microbatches=4", "mode=plan", "link_latency_s=0.001",
                       "action_overhead_s=0"])
    plan = prepare(cfg).plan
    fixed = 0.002
    slower = replace(plan, meta=replace(plan.meta, machine=replace(plan.meta.machine, action_overhead_s=fixed)))
    base, more = predict(plan, 0.001, cfg.link_bandwidth), predict(slower, 0.001, cfg.link_bandwidth)
    # a rank runs 2m compute actions one after another, each now `fixed` longer
    assert more.result.makespan_s - base.result.makespan_s >= 2 * plan.microbatches * fixed - 1e-9
    # a message's latency is on the critical path too: dearer links, longer step
    dearer = predict(plan, 0.01, cfg.link_bandwidth)
    assert dearer.result.makespan_s > base.result.makespan_s + 0.01
