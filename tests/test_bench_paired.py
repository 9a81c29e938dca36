"""bench/paired_runtimes.py on a small GPT: our runtime and torch.distributed.pipelining, in the same
two processes on the same split, must compute the same losses step for step (an independent check
of our runtime), and the harness the benchmark relies on must keep working."""

from __future__ import annotations

import sys

import pytest

from tests.harness import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from _torch_pp import BenchConfig, PipelineJob, compose_our_run  # noqa: E402
from paired_runtimes import PairedJob, run_pair  # noqa: E402


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_ours_and_torch_agree_step_by_step(schedule: str) -> None:
    bench = BenchConfig(vocab_size=64, dim=32, layers=4, heads=2, seq_len=8, batch_size=16, microbatches=4)
    cfg, plan = compose_our_run(schedule, bench)
    blocks = [list(s.blocks) for s in plan.stages]
    job = PipelineJob(schedule, list(plan.schedule.placement), blocks, bench)
    got = run_pair(PairedJob(cfg, plan, job, steps=3, host_setup=True))
    ours, theirs = got["losses"]["ours"], got["losses"]["torch"]
    assert len(ours) == len(theirs) == 3 and len(got["times"]["ours"]) == 3
    assert ours[-1] < ours[0]  # SGD on a learnable chain: both really trained
    assert ours == pytest.approx(theirs, rel=1e-5), (ours, theirs)
