"""What every run leaves behind: predicted vs measured figures, a Perfetto trace, a timeline PNG."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.planner.predict.costs import cost_model_from_events
from pipelaunch.pipeline.planner.predict.simulate import simulate
from pipelaunch.pipeline.report.tables import stage_rows
from pipelaunch.pipeline.report.timeline import draw_timeline, write_chrome_trace


def add_predictions(metrics: dict, plan: Plan, events: Sequence[dict], link: tuple[float, float], overhead_s: float,
                    window: Sequence[dict] | None = None) -> list[dict]:
    """Simulate this run's schedule on the costs measured in this run and record both side by side
    (`link`: the simulator's latency in seconds and bandwidth in bytes/s).

    The costs are the medians of each (stage, kind) over `window`, the events of the steps after
    warm-up (each tagged with its `step`), or over `events`, the last step's; one step alone
    swings by tens of percent on a shared machine. `measured_schedule_s` is the median span of
    those steps. `predicted_step_time_s` = simulated schedule makespan + the measured time spent
    outside the schedule (data-parallel sync, optimizer step, loss reduction). Returns the
    simulated events.
    """
    if not events:
        return []
    priced = window or events
    cost = cost_model_from_events(plan, priced, *link)
    result = simulate(plan.schedule, cost)
    metrics["predicted_schedule_s"] = result.makespan_s
    metrics["predicted_step_time_s"] = result.makespan_s + overhead_s
    steps: dict = defaultdict(list)
    for e in priced:
        steps[e.get("step")].append(e)
    metrics["measured_schedule_s"] = statistics.median(
        max(e["end_s"] for e in step) - min(e["start_s"] for e in step) for step in steps.values())
    metrics["schedule_overhead_s"] = overhead_s
    for info in metrics["ranks"]:
        info["predicted_bubble"] = result.bubble[info["pp_rank"]]
    metrics["stage_costs"] = {
        "forward_s": cost.forward_s, "backward_input_s": cost.backward_input_s,
        "backward_weight_s": cost.backward_weight_s, "backward_s": cost.backward_s, "recompute_s": cost.recompute_s,
    }
    return result.events


def write_run_artifacts(run_dir: Path, metrics: dict, events: Sequence[dict], simulated: Sequence[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    if events:
        write_chrome_trace(run_dir / "trace.json", events)
        title = f"{metrics.get('schedule')} pp={metrics['config']['pp']} m={metrics['config']['microbatches']}"
        draw_timeline(run_dir / "timeline.png", events, simulated or None, title=title)


def report_run(rank0: dict, plan: Plan, link: tuple[float, float], run_dir: Path | None) -> dict:
    """What the launcher does with rank 0's result once the ranks are done: the stage table, the
    run's own step simulated on the costs it measured beside what it measured, and, with a run
    directory, metrics.json, trace.json and timeline.png. Done here, not in the rank, so that no
    rank imports the simulator. Returns the metrics."""
    metrics, events = rank0["metrics"], rank0.get("events", [])
    metrics["stages"] = stage_rows(plan)
    simulated = add_predictions(metrics, plan, events, link, rank0.get("overhead_s", 0.0),
                                rank0.get("cost_events") or None)
    if run_dir is not None:
        write_run_artifacts(run_dir, metrics, events, simulated)
    return metrics
