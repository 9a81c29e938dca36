"""1F1B: after a warm-up of p-1-r forwards, rank r alternates one forward and one backward.

Same bubble as GPipe, but rank r holds at most p-r micro-batches of activations instead of m.
Fewer micro-batches than stages run as Megatron runs them: the warm-up stops at the last one, so
the pipeline never fills (a small global batch over many replicas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.ir import Action, B, F
from pipelaunch.pipeline.planner.schedules.base import (
    ScheduleCosts,
    ScheduleGenerator,
    require_microbatches_at_least,
)


@dataclass(frozen=True)
class OneFOneB(ScheduleGenerator):
    name: ClassVar[str] = "1f1b"

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        super().check(pp, microbatches, placement)
        require_microbatches_at_least(self.name, microbatches, 1, "it needs at least one micro-batch")

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = len(placement)
        programs: list[list[Action]] = []
        for rank in range(pp):
            stage = placement.index(rank)
            warmup = min(pp - 1 - rank, microbatches)
            acts = [F(stage, mb) for mb in range(warmup)]
            for i in range(microbatches - warmup):
                acts.append(F(stage, warmup + i))
                acts.append(B(stage, i))
            acts.extend(B(stage, mb) for mb in range(microbatches - warmup, microbatches))
            programs.append(acts)
        return programs
