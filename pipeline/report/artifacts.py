"""What every run leaves behind: predicted vs measured figures, a Perfetto trace, a timeline PNG."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from pipelaunch.pipeline.core.plan import Plan
from pipelaunch.pipeline.core.results import RankResult
from pipelaunch.pipeline.planner.predict.costs import cost_model_from_events
from pipelaunch.pipeline.planner.predict.simulate import simulate
from pipelaunch.pipeline.report.metrics import MeasuredStep, RunMetrics
from pipelaunch.pipeline.report.tables import stage_rows
from pipelaunch.pipeline.report.timeline import draw_timeline, write_chrome_trace


def measure_run(plan: Plan, events: Sequence[dict], link: tuple[float, float], overhead_s: float,
                window: Sequence[dict] | None = None) -> tuple[MeasuredStep | None, list[float], list[dict]]:
    """Simulate this run's schedule on the costs measured in this run, to record beside what it
    measured (`link`: the simulator's latency in seconds and bandwidth in bytes/s). Returns the
    simulated step (None without events), the simulated bubble per pipeline rank, and the
    simulated events.

    The costs are the medians of each (stage, kind) over `window`, the events of the steps after
    warm-up (each tagged with its `step`), or over `events`, the last step's; one step alone
    swings by tens of percent on a shared machine. `measured_schedule_s` is the median span of
    those steps. `predicted_step_time_s` = simulated schedule makespan + the measured time spent
    outside the schedule (data-parallel sync, optimizer step, loss reduction).
    """
    if not events:
        return None, [], []
    priced = window or events
    cost = cost_model_from_events(plan, priced, *link)
    result = simulate(plan.schedule, cost)
    steps: dict = defaultdict(list)
    for e in priced:
        steps[e.get("step")].append(e)
    measured = statistics.median(
        max(e["end_s"] for e in step) - min(e["start_s"] for e in step) for step in steps.values())
    costs = {"forward_s": cost.forward_s, "backward_input_s": cost.backward_input_s,
             "backward_weight_s": cost.backward_weight_s, "backward_s": cost.backward_s,
             "recompute_s": cost.recompute_s}
    step = MeasuredStep(result.makespan_s, result.makespan_s + overhead_s, measured, overhead_s, costs)
    return step, list(result.bubble), result.events


def timeline_title(plan: Plan) -> str:
    """The run's timeline title: the schedule, pipeline ranks and micro-batches the plan ran (a
    plan=auto run's may differ from the configured count)."""
    return f"{plan.schedule.name} pp={plan.pp} m={plan.microbatches}"


def write_run_artifacts(run_dir: Path, metrics: RunMetrics, plan: Plan, events: Sequence[dict],
                        simulated: Sequence[dict]) -> None:
    """metrics.json, and with events the Perfetto trace and the timeline PNG."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(metrics.to_json(), indent=1, default=str))
    if events:
        write_chrome_trace(run_dir / "trace.json", events)
        draw_timeline(run_dir / "timeline.png", events, simulated or None, title=timeline_title(plan))


def report_run(rank0: RankResult, plan: Plan, config: dict, link: tuple[float, float], launcher_peak_bytes: float,
               run_dir: Path | None) -> RunMetrics:
    """What the launcher does with rank 0's result once the ranks are done: the run's metrics (its
    history, what the plan ran and predicted, the stage rows, and the run's own step simulated on
    the costs it measured beside what it measured, with each rank's simulated bubble) and, with a
    run directory, metrics.json, trace.json and timeline.png. Done here, not in the rank, so
    that no rank imports the simulator. `link`: the latency (s) and bandwidth (bytes/s) priced."""
    measured, bubble, simulated = measure_run(plan, rank0.events, link, rank0.overhead_s,
                                              rank0.cost_events or None)
    if rank0.history is None:
        raise ValueError("report_run reads rank 0's result: it alone carries the run's history")
    for facts in rank0.history.ranks if bubble else ():
        facts.predicted_bubble = bubble[facts.pp_rank]
    meta = plan.meta
    metrics = RunMetrics(config, rank0.history, plan.schedule.name, meta.partition, meta.prediction, meta.search,
                         launcher_peak_bytes, link[0], meta.machine.action_overhead_s, stage_rows(plan), measured)
    if run_dir is not None:
        write_run_artifacts(run_dir, metrics, plan, rank0.events, simulated)
    return metrics
