"""bench/paired_runtimes.py on a small GPT: our runtime and torch.distributed.pipelining, in the same
two processes on the same split, must compute the same losses step for step (an independent check
of our runtime), and the harness the benchmark relies on must keep working."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest

from tests.harness import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from _torch_pp import BenchConfig, PipelineJob, compose_our_run  # noqa: E402
from paired_runtimes import PairedJob, perfect_step_s, run_pair  # noqa: E402

from pipelaunch.pipeline.planner.placement import linear  # noqa: E402
from pipelaunch.pipeline.planner.schedules import build_schedule  # noqa: E402
from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB  # noqa: E402


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_ours_and_torch_agree_step_by_step(schedule: str) -> None:
    bench = BenchConfig(vocab_size=64, dim=32, layers=4, heads=2, seq_len=8, batch_size=16, microbatches=4)
    cfg, plan = compose_our_run(schedule, bench)
    blocks = [list(s.blocks) for s in plan.stages]
    job = PipelineJob(schedule, list(plan.schedule.placement), blocks, bench)
    got = run_pair(PairedJob(cfg, plan, job, steps=3, host_setup=True, warmup=1))
    ours, theirs = got["losses"]["ours"], got["losses"]["torch"]
    assert len(ours) == len(theirs) == 3 and len(got["times"]["ours"]) == 3
    assert ours[-1] < ours[0]  # SGD on a learnable chain: both really trained
    assert ours == pytest.approx(theirs, rel=1e-5), (ours, theirs)
    assert 0 < got["perfect_step_s"] < math.inf  # the ceiling column has a figure to show


def test_perfect_step_is_the_schedule_on_measured_costs_plus_time_outside_it() -> None:
    """1f1b, p=2, m=4, F=1 and B=2 on both stages: (m + p - 1)(F + B) = 15, plus the median of
    the critical rank's time outside the schedule."""
    plan = SimpleNamespace(schedule=build_schedule(OneFOneB(), linear(2), 4), moe_overlap=False,
                           stages=[SimpleNamespace(recv_bytes=0, send_bytes=0, inputs={}, index=s) for s in range(2)])
    events = [{"stage": s, "kind": k, "mb": mb, "start_s": 10.0, "end_s": 10.0 + d}
              for s in (0, 1) for mb in range(4) for k, d in (("F", 1.0), ("B", 2.0))]
    assert perfect_step_s(plan, events, [0.5, 0.3, 0.4]) == pytest.approx(15.4)
