"""V-Half and V-Min: V schedules whose activation memory is a set fraction of 1F1B's.

Why: "Pipeline Parallelism with Controllable Memory" (Qi et al., NeurIPS 2024) shows that on the V
placement (rank r holds stages r and 2p-1-r, each half a 1F1B stage) a micro-batch's activations live
on a rank only while it travels down and back up the V past that rank, so the memory a rank needs is
set by how many micro-batches are let in at once, not by p: V-Half holds about half of 1F1B's
activations (ceil(p/2)+1 stage-micro-batches) at a smaller bubble than 1F1B's, V-Min about a third
(ceil(p/3)+1) at a bubble like 1F1B's.

How: a budget of chunk-micro-batches per rank (two chunks make one stage-micro-batch). Two kinds of
critical order (F and I per rank) are tried, and `weight_fill` splits each backward and places its W
under the budget; the fastest is kept:

- the paper's building block: one micro-batch's passes laid out as tight as the costs allow (down
  the V forward, back up with the input gradients), repeated every period (the busiest rank's work
  for one micro-batch), each rank running its passes in the order of their times. The tight block
  alone holds about a third of 1F1B's activations (V-Min); the first micro-batches are let in
  faster than the period (up to `front` periods ahead, a rank's forwards apart) where the budget has room, which
  fills the warm-up (V-Half);
- a greedy play-through on the measured costs (`zero_bubble.list_schedule`, full backward) with the
  budget shared between the rank's two chunks in proportion to how long each keeps a micro-batch
  (chunk 0 of rank r: the trip through 2(2p-1-r)+1 stages; chunk 1: 2r+1), which wins on short
  pipelines.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.core.ir import Action, I, Kind, action_table
from pipelaunch.pipeline.planner.placement import v_shape
from pipelaunch.pipeline.planner.schedules.base import (
    Candidate,
    ScheduleGenerator,
    require_microbatches_at_least,
)
from pipelaunch.pipeline.planner.schedules.weight_fill import StageCosts
from pipelaunch.pipeline.planner.schedules.zero_bubble import ALPHAS, list_schedule

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


def block_order(placement: list[int], microbatches: int, costs: StageCosts, front: float) -> list[list[Action]]:
    """Per rank, the F and I of the building block repeated (module docstring), in the order of their
    times: micro-batch k's block starts at max(k * fast, (k - front) * period), where the period is
    the busiest rank's F + I + W for one micro-batch and `fast` its forwards alone. Every rank orders by one clock that
    respects the dependencies, so the orders never wait on each other in a cycle."""
    n, pp = len(placement), max(placement) + 1
    forward = [0.0] * n
    for s in range(1, n):
        forward[s] = forward[s - 1] + costs.forward[s - 1] + costs.hop[s - 1]
    back = [0.0] * n
    back[n - 1] = forward[n - 1] + costs.forward[n - 1]
    for s in range(n - 2, -1, -1):
        back[s] = back[s + 1] + costs.input_grad[s + 1] + costs.hop[s]
    work, forwards = [0.0] * pp, [0.0] * pp
    for s in range(n):
        work[placement[s]] += costs.forward[s] + costs.input_grad[s] + costs.weight_grad[s]
        forwards[placement[s]] += costs.forward[s]
    period, fast = max(work), max(forwards)
    start = [max(k * fast, k * period - front * period) for k in range(microbatches)]
    timed: list[list[tuple[float, int, int, int]]] = [[] for _ in range(pp)]
    for s in range(n):
        for k in range(microbatches):  # at equal times an input gradient first: it frees memory
            timed[placement[s]] += [(forward[s] + start[k], 1, s, k), (back[s] + start[k], 0, s, k)]
    forwards, inputs = action_table(Kind.F, n, microbatches), action_table(Kind.I, n, microbatches)
    return [[(forwards if kind else inputs)[s * microbatches + k] for _, kind, s, k in sorted(events)]
            for events in timed]


def fronts(pp: int, budget: int) -> list[int]:
    """How many periods ahead to let the first micro-batches in, most promising first: about half the
    budget the tight block leaves unused (it holds about (4p + 1) / 6 chunk-micro-batches a rank)."""
    guess = max(0, int((budget - (4 * pp + 1) / 6) // 2))
    return list(dict.fromkeys(f for f in (guess, guess - 1, guess + 1, guess - 2, 0) if f >= 0))


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
        return self.best_filled(self._candidates(placement, microbatches), placement, microbatches)

    def _candidates(self, placement: list[int], microbatches: int) -> Iterator[Candidate]:
        """The building block's orders first (each front, W placed two ways), then the greedy
        play-throughs, built only when `best_filled` gets to them (they are the slower to make)."""
        pp = max(placement) + 1
        budget = budget_chunks(pp, self.memory)
        costs = self.stage_costs(len(placement))
        for front in fronts(pp, budget):
            order = block_order(placement, microbatches, costs, front)
            yield from (Candidate(order, [budget] * pp, alpha) for alpha in ALPHAS[:2])
        for shift in (0, -1, 1):
            try:
                order = self.play_through(list_schedule, placement, microbatches, split_backward=False,
                                          cap=[budget] * pp, stage_cap=stage_caps(pp, budget, shift),
                                          forward_first=False)
            except ConfigError:
                continue
            critical = [[I(a.stage, a.mb) if a.kind is Kind.B else a for a in acts] for acts in order]
            yield from (Candidate(critical, [budget] * pp, alpha) for alpha in ALPHAS)


@dataclass
class VMin(VHalf):
    """V-Min: at most ceil(p/3)+1 stage-micro-batches of activations per rank."""

    name: ClassVar[str] = "v_min"
    memory: ClassVar[str] = "min"
