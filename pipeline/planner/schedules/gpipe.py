"""GPipe: all forwards, then all backwards. Bubble (p-1)/(m+p-1), holds m micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.ir import Action, B, F
from pipelaunch.pipeline.planner.schedules.base import ScheduleCosts, ScheduleGenerator


@dataclass(frozen=True)
class GPipe(ScheduleGenerator):
    name: ClassVar[str] = "gpipe"
    supported_placements: ClassVar[tuple[str, ...]] = ("linear", "interleaved", "v", "explicit")

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        # Any placement works: per rank, forwards in stage order then backwards in reverse stage order
        # respect every dependency.
        return None

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        pp = max(placement) + 1
        programs: list[list[Action]] = [[] for _ in range(pp)]
        for rank in range(pp):
            stages = [s for s, r in enumerate(placement) if r == rank]
            for s in stages:
                programs[rank].extend(F(s, mb) for mb in range(microbatches))
            for s in reversed(stages):
                programs[rank].extend(B(s, mb) for mb in range(microbatches))
        return programs
