"""V-Half and V-Min: V schedules whose activation memory is a set fraction of 1F1B's.

Why: "Pipeline Parallelism with Controllable Memory" (Qi et al., NeurIPS 2024) shows that on the V
placement (rank r holds stages r and 2p-1-r, each half a 1F1B stage) a micro-batch's activations live
on a rank only while it travels down and back up the V past that rank, so the memory a rank needs is
set by how many micro-batches are let in at once, not by p: V-Half holds about half of 1F1B's
activations (ceil(p/2)+1 stage-micro-batches) at a smaller bubble than 1F1B's, V-Min about a third
(ceil(p/3)+1) at a bubble like 1F1B's.

How: a budget of chunk-micro-batches per rank (two chunks make one stage-micro-batch), shared
between the rank's two chunks in proportion to how long each keeps a micro-batch (chunk 0 of rank r:
the trip through 2(2p-1-r)+1 stages; chunk 1: 2r+1). A greedy play-through on the measured costs
(`zero_bubble.list_schedule`, full backward, per-stage caps) gives the critical order, and
`weight_fill` splits each backward and places its W under the rank's budget. Several splits of the
budget are tried and the fastest kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from pipeline.core.errors import ConfigError
from pipeline.core.ir import Action, I, Kind
from pipeline.planner.placement import v_shape
from pipeline.planner.schedules.base import Candidate, ScheduleGenerator, require_microbatches_at_least
from pipeline.planner.schedules.zero_bubble import ALPHAS, list_schedule

#: memory -> the divisor of p: the most stage-micro-batches a rank holds is ceil(p / divisor) + 1
DIVISORS = {"half": 2, "min": 3}


def budget_chunks(pp: int, memory: str) -> int:
    """The chunk-micro-batches a rank may hold: twice ceil(p / divisor) + 1 stage-micro-batches."""
    return 2 * (math.ceil(pp / DIVISORS[memory]) + 1)


def stage_caps(pp: int, budget: int, shift: int = 0) -> list[int]:
    """Per stage of the V, its share of its rank's budget (see the module docstring), chunk 0's
    share moved by `shift`; each chunk keeps at least one."""
    caps = [0] * (2 * pp)
    for r in range(pp):
        life0, life1 = 2 * (2 * pp - 1 - r) + 1, 2 * r + 1
        first = min(budget - 1, max(1, round(budget * life0 / (life0 + life1)) + shift))
        caps[r], caps[2 * pp - 1 - r] = first, budget - first
    return caps


@dataclass
class VHalf(ScheduleGenerator):
    """V-Half: at most ceil(p/2)+1 stage-micro-batches of activations per rank; V-Min derives from
    it with another `memory` (a key of DIVISORS)."""

    name: ClassVar[str] = "v_half"
    memory: ClassVar[str] = "half"
    default_placement: ClassVar[str] = "v"
    supported_placements: ClassVar[tuple[str, ...]] = ("v",)
    split_backward: ClassVar[bool] = True
    #: order and place the W on the measured per-stage costs (else F = I = W units)
    cost_aware: bool = True

    def stages_per_rank(self) -> int:
        return 2

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        if list(placement) != v_shape(pp):
            raise ConfigError("placement", f"scheduler {self.name!r} needs the V placement {v_shape(pp)} "
                                           f"(placement=v or auto), got {placement}")
        require_microbatches_at_least(self.name, microbatches, 1, "it needs at least one micro-batch")

    def compute_actions(self, placement: list[int], microbatches: int) -> list[list[Action]]:
        pp = max(placement) + 1
        budget = budget_chunks(pp, self.memory)
        candidates = []
        for shift in (0, -1, 1):
            try:
                order = self.play_through(list_schedule, placement, microbatches, split_backward=False,
                                          cap=[budget] * pp, stage_cap=stage_caps(pp, budget, shift),
                                          forward_first=False)
            except ConfigError:
                continue
            critical = [[I(a.stage, a.mb) if a.kind is Kind.B else a for a in acts] for acts in order]
            candidates += [Candidate(critical, [budget] * pp, alpha) for alpha in ALPHAS]
        return self.best_filled(candidates, placement, microbatches)


@dataclass
class VMin(VHalf):
    """V-Min: at most ceil(p/3)+1 stage-micro-batches of activations per rank."""

    name: ClassVar[str] = "v_min"
    memory: ClassVar[str] = "min"
