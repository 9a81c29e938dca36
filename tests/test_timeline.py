"""Timeline PNG and Chrome trace export from simulated (and 'measured') events."""

from __future__ import annotations

import json

from pipelaunch.pipeline.planner.placement import linear, v_shape
from pipelaunch.pipeline.planner.predict.simulate import CostModel, simulate
from pipelaunch.pipeline.planner.schedules import build_schedule
from pipelaunch.pipeline.planner.schedules.one_f_one_b import OneFOneB
from pipelaunch.pipeline.planner.schedules.zbv import ZBV
from pipelaunch.pipeline.report.timeline import draw_timeline, write_chrome_trace


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

    from pipelaunch.launcher.validate import prepare
    from pipelaunch.pipeline.report.artifacts import measure_run
    from tests.harness import FAST, compose_cfg

    plan = prepare(compose_cfg([*FAST, "pp=2", "scheduler=1f1b", "microbatches=2", "mode=plan"]), profile=False).plan
    window, origin = [], 0.0
    for step, scale in enumerate((1.0, 2.0, 10.0)):  # the last step is five times slower
        sim = simulate(plan.schedule, CostModel.uniform(2, f=scale, i=scale, w=scale)).events
        window += [{**e, "step": step, "start_s": e["start_s"] + origin, "end_s": e["end_s"] + origin} for e in sim]
        origin += 1000.0
    last = [e for e in window if e["step"] == 2]
    measured, _, _ = measure_run(plan, last, (5e-5, 1e9), 0.0, window)
    assert measured.stage_costs["forward_s"] == pytest.approx([2.0, 2.0])  # the median step's
    one_step = simulate(plan.schedule, CostModel.uniform(2, f=2.0, i=2.0, w=2.0)).makespan_s
    assert measured.measured_schedule_s == pytest.approx(one_step)
    only_last, _, _ = measure_run(plan, last, (5e-5, 1e9), 0.0)
    assert only_last.stage_costs["forward_s"] == pytest.approx([10.0, 10.0])


def test_a_runs_timeline_is_labelled_with_the_micro_batches_its_plan_ran(tmp_path, monkeypatch) -> None:
    """plan=auto may run another micro-batch count than the config's: the timeline's title says
    the plan's (here a search over 2 and 4 where the config says 1)."""
    from pipelaunch.launcher.validate import prepare
    from pipelaunch.pipeline.core.results import RankFacts, RankResult, TrainingHistory
    from pipelaunch.pipeline.report import artifacts
    from tests.harness import FAST, compose_cfg

    cfg = compose_cfg([*FAST, "pp=2", "microbatches=1", "plan=auto", "plan.microbatches=[2,4]", "mode=plan"])
    plan = prepare(cfg).plan
    assert plan.microbatches != cfg.microbatches
    titles = []
    monkeypatch.setattr(artifacts, "draw_timeline", lambda path, *events, title: titles.append(title))
    events = simulate(plan.schedule, CostModel.uniform(plan.schedule.num_stages)).events
    facts = RankFacts(0, 0, 0, [0], {0: plan.stages[0].blocks}, 1.0, 0.0, 1.0, None, None, None, 0.0, 0.0,
                      "cpu", None, False, [], "by_name")
    history = TrainingHistory([1.0], [None], [], 0, None, [], 1.0, [1.0], 1.0, "tokens", [facts])
    rank0 = RankResult([1.0], facts, history=history, events=events)
    metrics = artifacts.report_run(rank0, plan, cfg.to_dict(), (5e-5, 1e9), 0.0, tmp_path)
    assert titles == [f"{plan.schedule.name} pp=2 m={plan.microbatches}"]
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written == json.loads(json.dumps(metrics.to_json(), default=str))
    assert written["config"]["microbatches"] == 1 and written["ranks"][0]["predicted_bubble"] >= 0.0


def test_coverage_is_each_pixel_s_share_of_the_time() -> None:
    """A pixel column takes each kind's colour in proportion to the time that kind covers of it
    (what anti-aliased bars show); overlapping spans fill a pixel at most once."""
    import numpy as np

    from pipelaunch.pipeline.report.timeline import _blend, _coverage

    assert np.allclose(_coverage([(0.5, 1.0), (2.0, 0.25)], 1.0, 4), [0.5, 0.5, 0.25, 0.0])
    assert np.allclose(_coverage([(0.0, 2.0), (1.0, 2.0)], 1.0, 4), [1.0, 1.0, 1.0, 0.0])
    assert np.allclose(_coverage([(0.0, 10.0)], 0.5, 3), [1.0, 1.0, 1.0])  # clipped to the axes
    half = _blend({"#000000": np.array([0.5, 0.0])})[0]
    assert np.allclose(half, [[0.5] * 3, [1.0] * 3])  # half black over white; an idle pixel is white


def _panel(events: list[dict]):
    import matplotlib.pyplot as plt

    from pipelaunch.pipeline.report.timeline import _draw_panel, _set_margins

    fig, ax = plt.subplots(figsize=(12, 3))
    _set_margins(fig, 1, "rank 9")
    _draw_panel(ax, events, "t", 0.0)
    return fig, ax


def test_a_timeline_with_more_actions_than_pixels_is_drawn_as_rows_of_pixels() -> None:
    """64 ranks x 1000 actions would be bars narrower than their white edges: each rank becomes
    one row of pixels whose colours follow the time each kind takes, with nothing left white
    where the rank is busy; a small schedule keeps its bars and micro-batch labels."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import to_rgb

    from pipelaunch.pipeline.report.timeline import COLORS

    busy = [{"rank": r, "action": f"0{'FB'[i % 2]}{i}", "kind": "FB"[i % 2], "mb": i, "start_s": float(i),
             "end_s": i + 1.0} for r in range(3) for i in range(2000)]
    fig, ax = _panel(busy)
    assert len(ax.images) == 3 and not ax.collections and not ax.texts
    row = np.asarray(ax.images[0].get_array())[0]
    columns = row.shape[0]
    covered = row[: int(columns * 2000 / 2020)]  # the axis runs 1% past the last action
    mix = (np.asarray(to_rgb(COLORS["F"])) + np.asarray(to_rgb(COLORS["B"]))) / 2
    assert np.allclose(covered.mean(axis=0), mix, atol=0.02)
    plt.close(fig)
    fig, ax = _panel(_events())
    assert not ax.images and ax.collections and ax.texts
    plt.close(fig)
