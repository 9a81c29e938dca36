"""What every run leaves behind: predicted vs measured figures, a Perfetto trace, a timeline PNG."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pipeline.costs import cost_model_from_events
from pipeline.plan import Plan
from pipeline.report.timeline import draw_timeline, write_chrome_trace
from pipeline.simulate import simulate


def add_predictions(metrics: dict, plan: Plan, events: Sequence[dict], cfg: dict, overhead_s: float) -> list[dict]:
    """Simulate this run's schedule on the costs measured in this run and record both side by side.

    `predicted_step_time_s` = simulated schedule makespan + the measured time spent outside the
    schedule (data-parallel sync, optimizer step, loss reduction). Returns the simulated events.
    """
    if not events:
        return []
    cost = cost_model_from_events(plan, events, cfg.get("link_latency_s", 5e-5), cfg.get("link_bandwidth", 1e9))
    result = simulate(plan.schedule, cost)
    metrics["predicted_schedule_s"] = result.makespan_s
    metrics["predicted_step_time_s"] = result.makespan_s + overhead_s
    metrics["measured_schedule_s"] = max(e["end_s"] for e in events) - min(e["start_s"] for e in events)
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
