"""What a rank returns to the launcher once training ends (`RankResult`), typed.

The trainer (`pipelaunch.pipeline.runtime.trainer`) builds it; the launcher and the report
(`pipelaunch.pipeline.report.metrics.RunMetrics`) read rank 0's to write metrics.json. It lives
here, below both, since the runtime and the launcher each import it and neither imports the other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RankFacts:
    """One rank's entry in metrics.json's `ranks`: where it ran and what it held (bytes), its
    median busy time and bubble after warm-up, and where its weights came from."""

    rank: int
    pp_rank: int
    dp_rank: int
    stages: list[int]
    #: stage -> the traced nodes it runs
    blocks: dict[int, list[str]]
    peak_memory_bytes: float
    #: what the rank held before its model's tensors (on CPU: the interpreter and torch)
    memory_at_start_bytes: float
    #: the peak less that: the part the planner predicts (parameters, gradients, optimizer, activations)
    peak_above_start_bytes: float
    #: the tensors' own peak, as CUDA's allocator counts it (on CPU: the first steps, profiled)
    peak_tensor_bytes: float | None
    #: the plan's predicted peak of this pipeline rank (`PlanMeta.device_memory`), None without one
    predicted_peak_bytes: float | None
    #: what the rank held at its optimizer step (parameters, gradients, buffers, optimizer states;
    #: a sharded tensor by its local shard), the largest over the run; None without an optimizer step
    state_bytes: int | None
    busy_s: float
    bubble: float
    device: str
    cpu_cores: list[int] | None
    huge_pages: bool
    #: pretrained tensors this rank read by name (model.path): its own stages' only
    weights_read: list[str]
    #: where its initial weights came from: `constructor` or `by_name`
    initial_weights: str
    #: the bubble the report's simulation of this run predicts (set by the report, on rank 0's copy)
    predicted_bubble: float | None = None
    #: its place among the tp ranks of its pipeline rank (0 without tensor parallelism)
    tp_rank: int = 0

    def to_json(self) -> dict:
        """metrics.json's entry (`predicted_bubble` only once the report has set it)."""
        data = asdict(self)
        if self.predicted_bubble is None:
            del data["predicted_bubble"]
        return data


@dataclass
class TrainingHistory:
    """What rank 0 gathered of the whole run: per step its loss, learning rate, gradient norm
    (None unless clip_grad_norm is set) and time; held-out losses; where it started and the
    checkpoints it wrote; the median step time after warm-up and the throughput in
    `throughput_unit`s per second; and every rank's facts."""

    losses: list[float]
    lr: list[float | None]
    eval_loss: list[dict]
    start_step: int
    resumed_from: str | None
    checkpoints: list[str]
    step_time_s: float
    step_times_s: list[float]
    tokens_per_s: float
    throughput_unit: str
    ranks: list[RankFacts]
    grad_norm: list[float | None] | None = None
    #: the signal the run stopped for before its last step (SIGTERM, SIGUSR1), checkpointed then
    stopped_by: str | None = None
    #: on data that ignores targets (data=chat): scored tokens per second (the mean per step over
    #: the median step time), apart from `tokens_per_s`'s input tokens
    scored_tokens_per_s: float | None = None
    #: on data that pads (data=chat): the share of the input tokens that are padding, over the run
    padding_share: float | None = None
    #: a mixture of experts' router statistics: per step, {layer: {"min", "mean", "max"} tokens
    #: per expert over the global batch} (runtime/router_stats.py); None without MoE layers
    expert_load: list[dict] | None = None
    #: data.blend: per corpus its weight, the samples it gave this run and their realised share
    #: (pipeline/data/blend.py); None without a blend
    data_blend: dict | None = None


@dataclass
class RankResult:
    """What one rank returns: its losses and facts, what the trainer's callbacks added and, on rank
    0 only, the run's history, every rank's last-step events on one clock, the events of the
    steps after warm-up (each tagged with its `step`: what the report prices the run's own costs
    from) and the median time a step spends outside the schedule (`overhead_s`)."""

    losses: list[float]
    rank_info: RankFacts
    #: what each `trainer.Callback.result` returned, merged
    extras: dict[str, Any] = field(default_factory=dict)
    history: TrainingHistory | None = None
    events: list[dict] = field(default_factory=list)
    cost_events: list[dict] = field(default_factory=list)
    overhead_s: float = 0.0
    #: the signal every rank stopped for after the same step (runtime/preempt.py), or None
    stopped_by: str | None = None
