"""Hanayo (Liu et al., SC'23): wave-like pipeline over a zig-zag placement, no model duplication.

Why: stages go down the ranks 0..p-1 and come back up p-1..0 (once per wave), so a micro-batch
turns around on the last rank instead of idling there, and the drain of one wave overlaps the
fill of the next. Each rank holds 2 * waves stages (`pipelaunch.pipeline.planner.placement.wave`; waves=1 is the V
placement).

The order comes from the same greedy unit-cost play-through as ZBV (`list_schedule`), with a
full backward B and a cap of 2 * waves * p (stage, micro-batch) pairs per rank: 1F1B's activation
memory, as each stage is 1/(2 * waves) of a rank's share of the model. Any microbatches >= 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action
from pipelaunch.pipeline.planner.placement import wave
from pipelaunch.pipeline.planner.schedules.base import (
    ScheduleCosts,
    ScheduleGenerator,
    require_microbatches_at_least,
)
from pipelaunch.pipeline.planner.schedules.zero_bubble import list_schedule


@dataclass(frozen=True)
class Hanayo(ScheduleGenerator):
    """Wave schedule: `waves` zig-zags over the ranks, full backward."""

    name: ClassVar[str] = "hanayo"
    default_placement: ClassVar[str] = "v"
    supported_placements: ClassVar[tuple[str, ...]] = ("v",)

    waves: int = 1
    #: order actions by a play-through on the measured per-stage costs (else unit costs)
    cost_aware: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.waves, int) or self.waves < 1:
            raise ConfigError("scheduler.waves", f"must be an integer >= 1, got {self.waves!r}")

    def stages_per_rank(self) -> int:
        return 2 * self.waves

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        expected = wave(pp, self.waves)
        if list(placement) != expected:
            raise ConfigError(
                "placement",
                f"scheduler 'hanayo' with waves={self.waves} needs the zig-zag placement {expected} "
                f"({2 * self.waves} stages per rank; placement=v or auto), got {placement}",
            )
        require_microbatches_at_least(self.name, microbatches, 1, "it needs at least one micro-batch")

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = max(placement) + 1
        return self.play_through(list_schedule, placement, microbatches, costs, split_backward=False,
                                 cap=[2 * self.waves * pp] * pp, forward_first=True)
