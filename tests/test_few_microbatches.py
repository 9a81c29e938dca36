"""Fewer micro-batches than stages (#55), as Megatron runs them: 1F1B's warm-up stops at the last
micro-batch and the pipeline never fills; interleaved 1F1B takes any count, cut into equal groups
of pp or more (one group below pp). Exact like one process; every order lowers and plays without
a deadlock."""

from __future__ import annotations

import pytest

from pipelaunch.launcher.validate import prepare
from pipelaunch.pipeline.planner.placement import interleaved, linear
from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate
from pipelaunch.pipeline.planner.schedules import build_schedule
from pipelaunch.pipeline.planner.schedules.interleaved import Interleaved1F1B
from pipelaunch.pipeline.planner.schedules.interleaved_zb import InterleavedZB
from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB
from tests.harness import FAST, check_like_one_process, compose_cfg


def test_the_issue_command_plans() -> None:
    """`python train.py mode=plan pp=4 microbatches=2 batch_size=4` was refused."""
    plan = prepare(compose_cfg(["mode=plan", "pp=4", "microbatches=2", "batch_size=4"])).plan
    assert plan.microbatches == 2 and plan.pp == 4


@pytest.mark.parametrize("generator", [OneFOneB(), Interleaved1F1B(stages_per_rank=2), Interleaved1F1B(stages_per_rank=3),
                                       InterleavedZB(stages_per_rank=2)], ids=lambda g: f"{g.name}")
def test_every_count_plays_without_deadlock(generator) -> None:
    """pp 2-8, every micro-batch count from 1 to 3 pp + 1: each order is complete, plays to the
    end, and at m < pp a 1F1B step takes m + pp - 1 forward-backward slots (the unfilled bubble)."""
    for pp in (2, 3, 4, 5, 8):
        v = generator.stages_per_rank()
        placement = linear(pp) if v == 1 else interleaved(pp, v)
        for m in range(1, 3 * pp + 2):
            n = len(placement)
            result = simulate(build_schedule(generator, placement, m), CostModel([1.0] * n, [1.0] * n, [1.0] * n))
            if isinstance(generator, OneFOneB) and m < pp:
                assert result.makespan_s == pytest.approx(3.0 * (m + pp - 1)), (pp, m)


@pytest.mark.timeout(600)
def test_fewer_microbatches_than_stages_train_as_one_process(tmp_path) -> None:
    cases = [(f"{sched} pp={pp} m={m}", compose_cfg([*FAST, f"scheduler={sched}", f"pp={pp}", f"microbatches={m}",
                                                      f"batch_size={4 * m}"]))
             for sched, pp, m in (("1f1b", 4, 2), ("1f1b", 2, 1), ("interleaved_1f1b", 2, 3))]
    check_like_one_process(cases, tmp_path)
