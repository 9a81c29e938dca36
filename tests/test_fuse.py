"""Fusing I and W back into B where the split buys nothing: never a longer simulated step, every
(stage, micro-batch) still gets exactly one backward, and the steady state of ZBV runs fused."""

from __future__ import annotations

import pytest

from pipelaunch.pipeline.core.ir import Kind, Schedule
from pipelaunch.pipeline.planner.placement import v_shape
from pipelaunch.pipeline.planner.predict.simulate import makespan, validate
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts
from pipelaunch.pipeline.planner.schedules.fuse import MAX_WORK, fuse_slack_backwards
from pipelaunch.pipeline.planner.schedules.zbv import ZBV
from pipelaunch.pipeline.planner.schedules.zero_bubble import ZBH2


def count_fused(schedule: Schedule) -> int:
    """How many backwards of a split-backward schedule run fused (as B)."""
    return sum(1 for acts in schedule.actions for a in acts if a.kind is Kind.B)


UNEVEN = [1.0, 2.0, 1.5, 3.0, 1.2, 2.5, 0.8, 1.7]


def _costs(stages: int, uneven: bool) -> tuple:
    f = UNEVEN[:stages] if uneven else [1.0] * stages
    return f, f, [c / 2 for c in f] if uneven else f


@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize(("gen", "pp", "m"), [(ZBV, 2, 8), (ZBV, 4, 8), (ZBV, 3, 13), (ZBH2, 4, 8), (ZBH2, 2, 5)])
def test_fusing_never_lengthens_the_step(gen, pp: int, m: int, uneven: bool) -> None:
    placement = v_shape(pp) if gen is ZBV else list(range(pp))
    costs = _costs(len(placement), uneven)
    split, fused = gen(fuse_backward=False), gen()
    before = split.compute_actions(placement, m, ScheduleCosts.of(*costs))
    after = fused.compute_actions(placement, m, ScheduleCosts.of(*costs))
    schedule = Schedule(gen.name, len(placement), m, placement, after)
    validate(schedule)  # one F and one backward (B, or I and W) per (stage, micro-batch), right ranks
    assert makespan(after, placement, m, costs) <= makespan(before, placement, m, costs) * (1 + 1e-9)
    assert sum(len(a) for a in after) == sum(len(a) for a in before) - count_fused(schedule)


def test_zbv_steady_state_runs_fused_and_the_edges_stay_split() -> None:
    actions = ZBV().compute_actions(v_shape(2), 8)
    schedule = Schedule("zbv", 4, 8, v_shape(2), actions)
    assert count_fused(schedule) >= 8 * 4 // 2  # most of the 32 backwards
    kinds = {a.kind for acts in actions for a in acts}
    assert Kind.I in kinds and Kind.W in kinds  # the cool-down keeps deferred W


def test_large_schedules_are_left_alone() -> None:
    pp, m = 32, 64
    split = ZBV(fuse_backward=False).compute_actions(v_shape(pp), m)
    pairs = sum(1 for acts in split for a in acts if a.kind is Kind.I)
    assert pairs * sum(len(a) for a in split) > MAX_WORK
    assert fuse_slack_backwards(split, v_shape(pp), m, (1, 1, 1)) == split


@pytest.mark.parametrize(("gen", "pp", "m"), [(ZBV, 4, 8), (ZBH2, 4, 8), (ZBH2, 2, 5)])
def test_a_fused_backward_priced_below_i_plus_w_is_credited(gen, pp: int, m: int) -> None:
    """With B profiled at 90% of I + W (a split costs extra work), the pass fuses pairs in the same
    order whether or not it is credited, and the step the generator picks priced at those costs is
    never longer than the split one. (Credit need not fuse more: a cheaper B also moves the idle
    time inside the ranks' spans, which fusing may not grow.)"""
    placement = v_shape(pp) if gen is ZBV else list(range(pp))
    f, i, w = _costs(len(placement), uneven=True)
    fused_b = [0.9 * (a + b) for a, b in zip(i, w, strict=True)]
    split, plain, credited = gen(fuse_backward=False), gen(), gen()
    measured, measured_b = ScheduleCosts.of(f, i, w), ScheduleCosts.of(f, i, w, backward=fused_b)
    programs = {name: g.compute_actions(placement, m, c) for name, g, c in
                (("split", split, measured), ("plain", plain, measured), ("credited", credited, measured_b))}
    same = {name: fuse_slack_backwards(programs["split"], placement, m, (f, i, w), b)
            for name, b in (("plain", None), ("credited", fused_b))}
    count = {name: count_fused(Schedule(gen.name, len(placement), m, placement, p)) for name, p in same.items()}
    assert count["credited"] > 0 and count["plain"] > 0
    spans = {name: makespan(p, placement, m, (f, i, w), fused_b) for name, p in programs.items()}
    assert spans["credited"] <= spans["split"] * (1 + 1e-9)
