"""The typed parts of a Plan's metadata (`PlanMeta`): the partition summary, the prediction, the
search summary and the facts of the machine it was planned on.

Each is a frozen record whose fields, in order, are the keys plan.json has always held for it, so
`dataclasses.asdict` writes the same JSON and `from_json` reads a plan.json of an earlier version
(unknown keys dropped, missing ones left at their defaults).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

R = TypeVar("R")

MIB = 2**20


def known_fields(cls: type[R], data: dict) -> R:
    """`cls` from the keys of `data` it knows (a record written by another version loads)."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class PartitionSummary:
    """The partitioner's split as the one judge (`partition.evaluate`) priced it: per stage its
    time with communication, compute, parameter/activation/communication/memory bytes, the
    micro-batches it holds (and of those, with full activations), its input bytes; the slowest
    stage, the lower bound of any split, and the stages recomputing entirely."""

    bottleneck_s: float = 0.0
    lower_bound_s: float = 0.0
    stage_time_s: list[float] = field(default_factory=list)
    stage_compute_s: list[float] = field(default_factory=list)
    stage_param_bytes: list[int] = field(default_factory=list)
    stage_activation_bytes: list[float] = field(default_factory=list)
    stage_comm_bytes: list[int] = field(default_factory=list)
    stage_memory_bytes: list[int] = field(default_factory=list)
    stage_in_flight: list[int] = field(default_factory=list)
    stage_full_in_flight: list[int] = field(default_factory=list)
    stage_input_bytes: list[int] = field(default_factory=list)
    remat_stages: list[int] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict | None) -> PartitionSummary | None:
        """None for a plan without a partition (an empty dict in plan.json)."""
        return known_fields(cls, data) if data else None


@dataclass(frozen=True)
class DeviceMemory:
    """One pipeline rank's predicted peak, by what holds it (bytes): what the planner prices
    (`predict.memory.device_memory`) and PlanMeta keeps; plan.json writes its `total` too
    (`to_dict`), which loading drops (it is computed)."""

    rank: int
    params: float
    grads: float
    optimizer: float
    activations: float
    recompute: float = 0.0
    workspace: float = 0.0
    reserve: float = 0.0
    #: the update's temporaries after the backward (`UpdateMemory`)
    update: float = 0.0
    #: under zero=2/3, what one stage holds unsharded during its backward (`Sharding.gathered`)
    gathered: float = 0.0

    @property
    def backward(self) -> float:
        """What the schedule's phase holds above the parameters, gradients and optimizer state."""
        return self.activations + self.recompute + self.workspace + self.gathered

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + max(self.backward, self.update) + self.reserve

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}

    def breakdown(self) -> str:
        """`params 10.0 + grads 10.0 + optimizer 20.0 + activations 3.1 + ... MiB` (recompute and
        gathered when any; the update in place of the backward's terms where it is the larger)."""
        phase = [("activations", self.activations)] + ([("recompute", self.recompute)] if self.recompute else []) \
            + [("workspace", self.workspace)] + ([("gathered", self.gathered)] if self.gathered else [])
        text = " + ".join(f"{label} {value / MIB:.1f}" for label, value in phase)
        if self.update > self.backward:
            text = f"update {self.update / MIB:.1f} (more than the backward's {text})"
        return (f"params {self.params / MIB:.1f} + grads {self.grads / MIB:.1f} + optimizer {self.optimizer / MIB:.1f}"
                f" + {text} + reserve {self.reserve / MIB:.1f} MiB")


@dataclass(frozen=True)
class UnitCost:
    """One unit of a stage (pipeline/graph/units.py: the parameters gathered, released and reduced
    together) as the planner prices it: its name, the bytes of its parameters, and the profiled
    time its nodes take in each kind of action (0 without a profile). The root unit of a stage
    (parameters read at two distant places, gathered for a whole action) is named `root`."""

    name: str
    param_bytes: float
    forward_s: float = 0.0
    backward_s: float = 0.0
    backward_input_s: float = 0.0
    backward_weight_s: float = 0.0


@dataclass(frozen=True)
class PlannedStep:
    """The step the planner predicted for the plan as run: the whole step and its schedule part
    (the schedule stretched where ranks share cores), the simulated makespan, and per pipeline
    rank the bubble and the peak activation bytes."""

    step_time_s: float
    schedule_s: float
    makespan_s: float
    bubble_per_rank: list[float] = field(default_factory=list)
    peak_activation_bytes_per_rank: list[float] = field(default_factory=list)
    #: data.buckets: the step on the run's first steps' own micro-batch lengths
    #: (planner/predict/lengths.py: steps_priced, step_time_s, step_times_s, longest_step_time_s,
    #: mean_length); None: every micro-batch at model.seq_len
    variable_lengths: dict | None = None


@dataclass(frozen=True)
class SearchSummary:
    """What plan=auto (or scheduler=auto) compared and chose: the winner's settings (`chosen`: its
    label, config overrides and scheduler option), why it won, the search's time and counts,
    and the table rows of the winner, the best candidates, those over the memory budget and
    those that failed (rows are the search table's cells: `search.choose.Outcome.row`)."""

    chosen: dict[str, Any] = field(default_factory=dict)
    why: str = ""
    seconds: float = 0.0
    candidates: int = 0
    #: candidates left unsimulated by their closed-form estimate (`plan.simulate`)
    screened: int = 0
    #: what the simulated candidates' activations came to over their estimates' (search/screen.py)
    activation_scale: float = 1.0
    fit: int = 0
    over_budget: int = 0
    failed: int = 0
    winner: dict[str, Any] = field(default_factory=dict)
    top: list[dict] = field(default_factory=list)
    excluded: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class MachineFacts:
    """What the planner measured of the machine the plan runs on: local ranks' worth of cores
    when ranks outnumber them (CPU, else None), the optimizer step's seconds per parameter byte
    and its temporaries per byte (of a rank's largest tensor, of all its parameters:
    `optimizer_costs.optimizer_temporaries`), the runtime's seconds per message (the link
    latency, None: the config's) and per compute action (`planner.measure.overheads`)."""

    rank_slots: float | None = None
    optimizer_s_per_byte: float = 0.0
    optimizer_temporaries: list[float] = field(default_factory=lambda: [0.0, 0.0])
    link_latency_s: float | None = None
    action_overhead_s: float = 0.0
    #: where the costs come from: measured on this machine, or a hardware file's figures
    #: (`Hardware.source`: datasheet, or calibrated on a date)
    cost_source: str | None = None
    #: (seconds per ring step, bytes per second) of the link the replicas' collectives cross, when
    #: it is not the pipeline's (a hardware file: NVLink inside a node, the network across nodes)
    dp_link: list[float] | None = None
