"""Timeline PNG and Chrome trace export from simulated (and 'measured') events."""

from __future__ import annotations

import json

from pipeline.planner.placement import linear, v_shape
from pipeline.planner.schedules import build_schedule
from pipeline.planner.schedules.one_f_one_b import OneFOneB
from pipeline.planner.schedules.zbv import ZBV
from pipeline.planner.simulate import CostModel, simulate
from pipeline.report.timeline import draw_timeline, write_chrome_trace


def _events():
    sched = build_schedule(ZBV(), v_shape(4), 8)
    return simulate(sched, CostModel.uniform(8)).events


def test_png_single_and_compared(tmp_path) -> None:
    events = _events()
    measured = [dict(e, start_s=e["start_s"] * 1.1 + 50.0, end_s=e["end_s"] * 1.1 + 50.0) for e in events]
    measured.append({"rank": 1, "action": "0RECV_F3", "kind": "RECV_F", "start_s": 55.0, "end_s": 55.5})
    one = draw_timeline(tmp_path / "one.png", events, title="zbv")
    two = draw_timeline(tmp_path / "two.png", measured, events, title="measured vs simulated")
    for path in (one, two):
        data = open(path, "rb").read()
        assert data.startswith(b"\x89PNG") and len(data) > 5000


def test_chrome_trace(tmp_path) -> None:
    res = simulate(build_schedule(OneFOneB(), linear(3), 4), CostModel.uniform(3, f=0.001))
    path = write_chrome_trace(tmp_path / "trace.json", res.events)
    with open(path) as fh:
        trace = json.load(fh)
    evs = trace["traceEvents"]
    names = [e for e in evs if e["ph"] == "M"]
    assert sorted(e["args"]["name"] for e in names) == ["rank 0", "rank 1", "rank 2"]
    slices = [e for e in evs if e["ph"] == "X"]
    assert len(slices) == len(res.events)
    first = min(slices, key=lambda e: (e["tid"], e["ts"]))
    assert first["name"] == "0F0" and first["pid"] == 0 and first["tid"] == 0
    assert first["dur"] == 1000.0  # 1 ms in microseconds


def test_a_runs_own_costs_are_medians_over_the_steps_after_warm_up() -> None:
    """One slow step does not set the run's own per-stage costs or its measured schedule."""
    import pytest

    from launcher.validate import prepare
    from pipeline.report.artifacts import add_predictions
    from tests.harness import FAST, compose_cfg

    plan = prepare(compose_cfg([*FAST, "pp=2", "scheduler=1f1b", "microbatches=2", "mode=plan"]), profile=False).plan
    window, origin = [], 0.0
    for step, scale in enumerate((1.0, 2.0, 10.0)):  # the last step is five times slower
        sim = simulate(plan.schedule, CostModel.uniform(2, f=scale, i=scale, w=scale)).events
        window += [{**e, "step": step, "start_s": e["start_s"] + origin, "end_s": e["end_s"] + origin} for e in sim]
        origin += 1000.0
    last = [e for e in window if e["step"] == 2]
    metrics = {"ranks": []}
    add_predictions(metrics, plan, last, (5e-5, 1e9), 0.0, window)
    assert metrics["stage_costs"]["forward_s"] == pytest.approx([2.0, 2.0])  # the median step's
    one_step = simulate(plan.schedule, CostModel.uniform(2, f=2.0, i=2.0, w=2.0)).makespan_s
    assert metrics["measured_schedule_s"] == pytest.approx(one_step)
    only_last = {"ranks": []}
    add_predictions(only_last, plan, last, (5e-5, 1e9), 0.0)
    assert only_last["stage_costs"]["forward_s"] == pytest.approx([10.0, 10.0])
