"""Forward-only schedule for evaluation and serving: every rank forwards its stages in order.

Per rank, micro-batch-major order (all of micro-batch j's local stages before j+1) keeps each
micro-batch moving down the pipeline as soon as possible, on any placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.ir import Action, F
from pipelaunch.pipeline.planner.schedules.base import (
    ScheduleCosts,
    ScheduleGenerator,
    require_microbatches_at_least,
)


@dataclass(frozen=True)
class Inference(ScheduleGenerator):
    """Only F actions; no activations are kept for a backward."""

    name: ClassVar[str] = "inference"
    supported_placements: ClassVar[tuple[str, ...]] = ("linear", "interleaved", "v", "explicit")
    training: ClassVar[bool] = False

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        require_microbatches_at_least(self.name, microbatches, 1, "it needs at least one micro-batch")

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = max(placement) + 1
        programs: list[list[Action]] = [[] for _ in range(pp)]
        # Sorting by (mb, stage) gives each rank an order consistent with every dependency.
        for mb in range(microbatches):
            for s, rank in enumerate(placement):
                programs[rank].append(F(s, mb))
        return programs
