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


def _with_collectives(events: list[dict], ranks: tuple[int, ...]) -> list[dict]:
    """`events` and, on each of `ranks`, a gather before and a reduction after every other
    compute action (on the rank's `dp` lane, overlapping its compute as they would)."""
    dp = []
    for e in events:
        if e["rank"] in ranks and e["kind"] in ("F", "W", "B") and e["mb"] % 2 == 0:
            kind = "UNSHARD" if e["kind"] == "F" else "REDUCE_GRAD"
            start = e["start_s"] + (0.0 if kind == "UNSHARD" else 0.5 * (e["end_s"] - e["start_s"]))
            dp.append({"rank": e["rank"], "action": f"{e['stage']}{kind}{e['mb']}:stage", "kind": kind,
                       "stage": e["stage"], "mb": e["mb"], "start_s": start, "end_s": start + 0.4, "lane": "dp"})
    return events + dp


def _tick_labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_yticklabels()]


def test_a_rank_s_collectives_get_their_own_lane_under_its_row(tmp_path) -> None:
    """The data-parallel collectives of a rank are drawn on a thinner row of their own right under
    its compute (gathers and reductions in two colours); a trace without any keeps
    one row per rank. So do rows of pixels."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from pipelaunch.pipeline.report.timeline import DP_COLORS

    events = _events()
    fig, ax = _panel(events)
    assert _tick_labels(ax) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert list(ax.get_yticks()) == [0, 1, 2, 3]
    plt.close(fig)
    fig, ax = _panel(_with_collectives(events, (0, 2)))
    assert _tick_labels(ax) == ["rank 0", "rank 0 dp", "rank 1", "rank 2", "rank 2 dp", "rank 3"]
    ticks = list(ax.get_yticks())
    assert ticks == sorted(ticks) and ticks[2] - ticks[0] < 2 * (ticks[3] - ticks[2])  # a lane: thinner than a row
    bottom, top = ax.get_ylim()
    assert top < ticks[0] and bottom > ticks[-1]  # rank 0 on top
    colors = {to_hex(c) for coll in ax.collections for c in coll.get_facecolors()}
    assert {to_hex(DP_COLORS["UNSHARD"]), to_hex(DP_COLORS["REDUCE_GRAD"])} <= colors
    plt.close(fig)

    busy = [{"rank": r, "action": f"0{'FB'[i % 2]}{i}", "kind": "FB"[i % 2], "mb": i, "stage": 0,
             "start_s": float(i), "end_s": i + 1.0} for r in range(3) for i in range(2000)]
    fig, ax = _panel(_with_collectives(busy, (1,)))
    assert len(ax.images) == 4 and not ax.collections  # three rows of pixels and rank 1's lane
    assert _tick_labels(ax) == ["rank 0", "rank 1", "rank 1 dp", "rank 2"]
    plt.close(fig)

    plain = draw_timeline(tmp_path / "plain.png", events)
    lanes = draw_timeline(tmp_path / "lanes.png", _with_collectives(events, (0, 2)), events)
    for path in (plain, lanes):
        assert open(path, "rb").read().startswith(b"\x89PNG")


def test_the_trace_puts_a_rank_s_collectives_on_a_thread_of_their_own(tmp_path) -> None:
    """Perfetto shows each rank's collectives as a track of their own ("rank 0 dp")."""
    events = _with_collectives(_events(), (0, 1))
    with open(write_chrome_trace(tmp_path / "trace.json", events)) as fh:
        evs = json.load(fh)["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["rank 0", "rank 0 dp", "rank 1", "rank 1 dp", "rank 2", "rank 3"]
    slices = [e for e in evs if e["ph"] == "X"]
    assert len(slices) == len(events)
    compute_tids, dp_tids = set(), set()
    for event, piece in zip(events, slices, strict=True):  # in the events' order
        dp = event.get("lane") == "dp"
        assert threads[piece["tid"]] == f"rank {event['rank']}" + (" dp" if dp else "")
        (dp_tids if dp else compute_tids).add(piece["tid"])
    assert len(dp_tids) == 2 and not dp_tids & compute_tids


def test_a_rank_running_two_stages_writes_each_bar_s_stage() -> None:
    """A V schedule's rank 0 runs stages 0 and 3: its bars say "s0:1" and "s3:1", and the later
    stage is lighter; a rank of one stage writes the micro-batch alone."""
    import matplotlib.pyplot as plt

    from pipelaunch.pipeline.report.timeline import COLORS

    zbv = simulate(build_schedule(ZBV(), v_shape(2), 2), CostModel.uniform(4)).events
    fig, ax = _panel(zbv)
    rank0 = {t.get_text() for t in ax.texts if t.get_position()[1] == 0}
    assert {"s0:0", "s0:1", "s3:0", "s3:1"} <= rank0 and all(t[:3] in ("s0:", "s3:") for t in rank0)
    rank1 = {t.get_text() for t in ax.texts if t.get_position()[1] == 1}
    assert {"s1:0", "s2:1"} <= rank1
    forward = [c for c in ax.collections if any(tuple(f[:3]) == _rgb(COLORS["F"]) for f in c.get_facecolors())]
    assert len(forward) == 2  # stage 0's (rank 0) and stage 1's (rank 1); stages 3 and 2 lighter
    plt.close(fig)
    linear_events = simulate(build_schedule(OneFOneB(), linear(2), 2), CostModel.uniform(2)).events
    fig, ax = _panel(linear_events)
    assert {t.get_text() for t in ax.texts} == {"0", "1"}
    plt.close(fig)


def _rgb(color: str) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb
    return to_rgb(color)


def test_a_dry_run_of_replicas_draws_their_collectives(tmp_path, monkeypatch) -> None:
    """`python train.py mode=plan model=gpt_bench pp=2 dp=2 zero=3 scheduler=zbv` (the issue's
    command): the timeline it writes holds the simulated gathers and reductions, on dp lanes."""
    from pipelaunch.launcher import app
    from pipelaunch.launcher.validate import prepare
    from tests.harness import compose_cfg

    drawn = []

    def draw(path, events, *rest, **kw):
        drawn.append(list(events))
        return draw_timeline(path, events, *rest, **kw)

    monkeypatch.setattr(app, "draw_timeline", draw)
    prepared = prepare(compose_cfg(["mode=plan", "model=gpt_bench", "pp=2", "dp=2", "zero=3", "scheduler=zbv"]))
    app.dry_run(prepared, tmp_path)
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")
    [events] = drawn
    collectives = [e for e in events if e.get("lane") == "dp"]
    assert {e["kind"] for e in collectives} == {"UNSHARD", "REDUCE_GRAD"}
    assert {e["rank"] for e in collectives} == {0, 1}
    assert len(events) == len(prepared.prediction.result.events) + len(collectives)
