"""metrics.json, typed: `RunMetrics` is what a run reports, built once by the launcher from rank
0's `RankResult`, the Plan and the config, and written by `RunMetrics.to_json` alone.

docs/metrics.md lists every key, its type and unit, and which record it comes from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from pipelaunch.pipeline.core.plan_records import PartitionSummary, PlannedStep, SearchSummary
from pipelaunch.pipeline.core.results import TrainingHistory


@dataclass
class MeasuredStep:
    """The run's own step simulated on the per-stage costs it measured (medians over the steps
    after warm-up), beside the schedule's measured span: how far the cost model is off."""

    predicted_schedule_s: float
    #: the simulated schedule plus the measured time outside it (`schedule_overhead_s`)
    predicted_step_time_s: float
    measured_schedule_s: float
    schedule_overhead_s: float
    #: per kind (forward_s, backward_input_s, backward_weight_s, backward_s, recompute_s) per stage
    stage_costs: dict[str, list[float]]


@dataclass
class RunMetrics:
    """One run's metrics.json: the resolved config, rank 0's history, what the plan ran and
    predicted before any rank started, what the launcher measured of itself, the stage rows, and
    the run's own step simulated (`measured`, when the ranks recorded events)."""

    config: dict
    history: TrainingHistory
    schedule: str
    partition: PartitionSummary | None
    planned: PlannedStep | None
    plan_search: SearchSummary | None
    launcher_peak_memory_bytes: float
    link_latency_s: float
    action_overhead_s: float
    stages: list[dict]
    measured: MeasuredStep | None = None

    def to_json(self) -> dict:
        """metrics.json's object, in its documented key order; keys without a value are left out
        (grad_norm without clip_grad_norm, stopped_by unless a signal stopped the run, scored_tokens_per_s
        and padding_share unless the data ignores targets, expert_load without MoE layers, data_blend without data.blend, the planned step without a profile, plan_search
        without a search, the simulated step without events)."""
        history = {f.name: getattr(self.history, f.name) for f in fields(self.history)}
        grad_norm, stopped_by = history.pop("grad_norm"), history.pop("stopped_by")
        counts = {k: history.pop(k) for k in ("scored_tokens_per_s", "padding_share", "expert_load", "data_blend")}
        data = {"config": self.config, **history, "ranks": [r.to_json() for r in self.history.ranks],
                "schedule": self.schedule, "partition": asdict(self.partition) if self.partition else {}}
        if grad_norm is not None:
            data["grad_norm"] = grad_norm
        if stopped_by is not None:
            data["stopped_by"] = stopped_by
        data.update({k: v for k, v in counts.items() if v is not None})
        if self.planned is not None:
            data["planned_step_time_s"] = self.planned.step_time_s
            data["planned_schedule_s"] = self.planned.schedule_s
        if self.plan_search is not None:
            data["plan_search"] = asdict(self.plan_search)
        data.update(launcher_peak_memory_bytes=self.launcher_peak_memory_bytes, link_latency_s=self.link_latency_s,
                    action_overhead_s=self.action_overhead_s, stages=self.stages)
        if self.measured is not None:
            data.update(asdict(self.measured))
        return data
