"""torch.distributed.pipelining's schedules as orders in our IR: `scheduler=torch scheduler.schedule=<class>`.

Why: torch's schedule classes are the baseline users compare against. Lowering the per-rank compute
lists they generate into our IR lets the simulator price their orders on exactly the costs it prices
ours with, at any scale and without processes, and lets our runtime run them (trained on real ranks
like one process: the check that the import is right).

How the orders are read: torch's constructors want `PipelineStage`s but read only their shape
(`num_stages`, `group_size`, `group_rank`, `submod`), so each class is built over stand-ins
(`_StageShape`) and its `pipeline_order` (every rank's list) is read. The multi-stage classes' constructors
then lower that list to sends and receives (`_prepare_schedule_with_comms`: seconds at p=64, and our
own lowering does that job); a subclass keeps only the part of it that validates the order.

Mapping: torch numbers stages globally as we do; the rank of each stage is read off the orders and must
be the placement of the class's kind: linear (GPipe, 1F1B), round-robin `placement.interleaved`
(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) or `placement.v_shape` (ZBVZeroBubble, DualPipeV).
FULL_BACKWARD is our B, BACKWARD_INPUT I, BACKWARD_WEIGHT W; UNSHARD/RESHARD/REDUCE_GRAD are dropped.
DualPipeV's OVERLAP_F_B holds a forward and a backward of two stages that torch's runtime runs one after
the other: it becomes the two actions, adjacent, forward first, each pair listed in `overlapped`.

GPipe and 1F1B run their own loop rather than `pipeline_order`, numbering each rank's forwards and
backwards 0..m-1 in program order; their `pipeline_order` is a picture of that loop, and torch 2.13's
Schedule1F1B draws the last rank's forwards as micro-batches 1..m. For these two classes each kind's
actions are therefore numbered in program order, as their loop runs them (a no-op on a correct list).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, NamedTuple

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, Kind, Schedule
from pipelaunch.pipeline.planner.placement import from_kind
from pipelaunch.pipeline.planner.predict.simulate import ScheduleError, validate
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts, ScheduleGenerator
from pipelaunch.pipeline.planner.schedules.interleaved import _StagesPerRank


class TorchShape(NamedTuple):
    """What a torch class needs: its placement kind, its stages per rank (None: any, 2 by default)
    and whether its backward is split into I and W."""

    placement: str
    stages_per_rank: int | None
    split_backward: bool


#: torch's names (`torch.distributed.pipelining.schedules.get_schedule_class`) of the classes lowered here
SHAPES: dict[str, TorchShape] = {
    "GPipe": TorchShape("linear", 1, False),
    "1F1B": TorchShape("linear", 1, False),
    "Interleaved1F1B": TorchShape("interleaved", None, False),
    "LoopedBFS": TorchShape("interleaved", None, False),
    "InterleavedZeroBubble": TorchShape("interleaved", None, True),
    "ZBVZeroBubble": TorchShape("v", 2, True),
    "DualPipeV": TorchShape("v", 2, True),
}
_KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}
_OVERLAP = "OVERLAP_F_B"


class TorchOrder(NamedTuple):
    """A torch schedule in our IR: per rank its compute actions, the stage -> rank list read off them,
    and the (forward, backward) pairs torch runs as one OVERLAP_F_B action."""

    programs: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...]
    overlapped: tuple[tuple[Action, Action], ...]


def canonical_name(name: str) -> str:
    """torch's spelling of a schedule name given in any case; ConfigError listing the valid ones."""
    found = {k.lower(): k for k in SHAPES}.get(str(name).lower())
    if found is None:
        raise ConfigError("scheduler.schedule", f"unknown torch.distributed.pipelining schedule {name!r}; "
                                                f"valid: {', '.join(SHAPES)}")
    return found


class _StageShape:
    """A stand-in for a PipelineStage: the attributes torch's schedule constructors read."""

    def __init__(self, num_stages: int, pp: int) -> None:
        self.num_stages, self.group_size, self.group_rank, self.submod = num_stages, pp, 0, None
        self.stage_index_to_group_rank: dict[int, int] = {}


def torch_pipeline_order(name: str, pp: int, stages_per_rank: int, microbatches: int) -> dict[int, list[Any]]:
    """torch's own `pipeline_order` (rank -> list of its `_Action`s and None) for this shape; raises
    what torch's constructor raises (ValueError for a micro-batch count it refuses)."""
    from torch.distributed.pipelining import schedules as ts

    cls = ts.get_schedule_class(canonical_name(name))

    def validate_only(self, actions, format="compute_only"):  # noqa: A002 - torch's parameter name
        self._validate_and_set_stage_mapping(actions)

    orders = type(f"_{cls.__name__}Orders", (cls,), {"_prepare_schedule_with_comms": validate_only})
    stages = [_StageShape(pp * stages_per_rank, pp) for _ in range(stages_per_rank)]
    if issubclass(cls, ts.PipelineScheduleSingle):
        instance = orders(stages[0], microbatches)
    else:
        instance = orders(stages, microbatches)
    return dict(instance.pipeline_order)


def lower_order(order: Mapping[int, Sequence[Any]], renumber: bool = False
                ) -> tuple[list[list[Action]], list[tuple[Action, Action]]]:
    """torch's per-rank lists as our compute programs, and the overlapped (forward, backward) pairs.
    `renumber`: number each (stage, kind)'s actions 0, 1, ... in program order (GPipe's and 1F1B's loop)."""
    programs: list[list[Action]] = []
    overlapped: list[tuple[Action, Action]] = []
    for rank in range(len(order)):
        program: list[Action] = []
        for act in order[rank]:
            if act is None:
                continue
            kind = act.computation_type.value
            if kind == _OVERLAP:
                pair = _overlap_pair(act)
                program.extend(pair)
                overlapped.append(pair)
            elif kind in _KINDS:
                program.append(Action(act.stage_index, _KINDS[kind], act.microbatch_index))
        programs.append(_renumbered(program) if renumber else program)
    return programs, overlapped


def _overlap_pair(act: Any) -> tuple[Action, Action]:
    """An OVERLAP_F_B action as (forward, backward): torch's runtime runs the forward first."""
    subs = [Action(a.stage_index, _KINDS[a.computation_type.value], a.microbatch_index) for a in act.sub_actions or ()]
    forwards = [a for a in subs if a.kind is Kind.F]
    backwards = [a for a in subs if a.kind in (Kind.B, Kind.I)]
    if len(subs) != 2 or len(forwards) != 1 or len(backwards) != 1:
        raise ValueError(f"OVERLAP_F_B action {act!r}: expected one forward and one backward")
    return forwards[0], backwards[0]


def _renumbered(program: list[Action]) -> list[Action]:
    seen: dict[tuple[int, Kind], int] = {}
    out = []
    for a in program:
        key = (a.stage, a.kind)
        out.append(Action(a.stage, a.kind, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return out


@lru_cache(maxsize=64)
def torch_order(name: str, pp: int, stages_per_rank: int, microbatches: int) -> TorchOrder:
    """torch's order for this shape in our IR, validated (every (stage, micro-batch) forwarded and
    backwarded once, on one rank); raises torch's ValueError, or ScheduleError if the order is invalid."""
    from torch.distributed.pipelining import schedules as ts

    name = canonical_name(name)
    single = issubclass(ts.get_schedule_class(name), ts.PipelineScheduleSingle)
    programs, overlapped = lower_order(torch_pipeline_order(name, pp, stages_per_rank, microbatches), renumber=single)
    num_stages = pp * stages_per_rank
    placement = [-1] * num_stages
    for rank, program in enumerate(programs):
        for a in program:
            if a.stage < num_stages:  # an index out of range is validate's to report
                placement[a.stage] = rank
    validate(Schedule(f"torch {name}", num_stages, microbatches, placement, programs))
    return TorchOrder(tuple(map(tuple, programs)), tuple(placement), tuple(overlapped))


@dataclass(frozen=True)
class TorchSchedule(ScheduleGenerator):
    """One of torch.distributed.pipelining's schedule classes (`schedule`, torch's name), its order
    lowered into our IR: runs on our runtime, and is what our orders are compared with."""

    name: ClassVar[str] = "torch"
    #: torch's name of the class: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    #: ZBVZeroBubble or DualPipeV (any case)
    schedule: str = "ZBVZeroBubble"
    #: stages per rank where the class allows several (Interleaved1F1B, LoopedBFS,
    #: InterleavedZeroBubble); null = the class's own (1 for GPipe/1F1B, 2 for the others)
    stages_per_rank: int | None = None  # type: ignore[assignment]  # a field here, a method on the base

    def __post_init__(self) -> None:
        # normalised once, as the frozen value's own fields (dataclasses' idiom for a frozen __post_init__)
        object.__setattr__(self, "schedule", canonical_name(self.schedule))
        shape = SHAPES[self.schedule]
        count = self.stages_per_rank
        if count is None:
            count = shape.stages_per_rank or 2
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ConfigError("scheduler.stages_per_rank", f"must be an integer >= 1 or null, got {count!r}")
        if shape.stages_per_rank is not None and count != shape.stages_per_rank:
            raise ConfigError("scheduler.stages_per_rank",
                              f"torch's {self.schedule} holds exactly {shape.stages_per_rank} stage(s) per rank, "
                              f"got {count}; leave it null")
        object.__setattr__(self, "stages_per_rank", _StagesPerRank(count))

    @property
    def default_placement(self) -> str:  # type: ignore[override]
        return SHAPES[self.schedule].placement

    @property
    def supported_placements(self) -> tuple[str, ...]:  # type: ignore[override]
        return (SHAPES[self.schedule].placement,)

    @property
    def split_backward(self) -> bool:  # type: ignore[override]
        return SHAPES[self.schedule].split_backward

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        kind, count = self.default_placement, int(self.stages_per_rank)
        expected = from_kind(kind, pp, count)
        if list(placement) != expected:
            raise ConfigError("placement", f"scheduler 'torch' with schedule={self.schedule} needs the {kind} "
                                           f"placement {expected} (placement={kind} or auto), got {list(placement)}")
        if microbatches < 1:
            raise ConfigError("microbatches", f"scheduler 'torch' needs microbatches >= 1; got {microbatches}")
        order = self._order(pp, microbatches)
        if list(order.placement) != expected:
            raise ConfigError("scheduler.schedule", f"torch's {self.schedule} places stages on ranks "
                                                    f"{list(order.placement)}, not on the {kind} placement {expected}")

    def _order(self, pp: int, microbatches: int) -> TorchOrder:
        """torch's order, its refusals as ours: torch only refuses micro-batch counts for a valid shape."""
        try:
            return torch_order(self.schedule, pp, int(self.stages_per_rank), microbatches)
        except (ValueError, AssertionError) as err:
            if isinstance(err, ConfigError):
                raise
            what = "gives an invalid order" if isinstance(err, ScheduleError) else "refuses it"
            raise ConfigError("microbatches", f"torch.distributed.pipelining's {self.schedule} with pp={pp}, "
                                              f"{int(self.stages_per_rank)} stage(s) per rank and "
                                              f"microbatches={microbatches} {what}: {err}") from None

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        order = self._order(max(placement) + 1, microbatches)
        return [list(program) for program in order.programs]

    def overlapped(self, placement: list[int], microbatches: int) -> list[tuple[Action, Action]]:
        """The (forward, backward) pairs torch runs as one OVERLAP_F_B action (DualPipeV)."""
        return list(self._order(max(placement) + 1, microbatches).overlapped)


__all__ = ["SHAPES", "TorchOrder", "TorchSchedule", "canonical_name", "lower_order", "torch_order",
           "torch_pipeline_order"]
