"""V-Half and V-Min: V schedules whose activation memory is a set fraction of 1F1B's.

Why: "Pipeline Parallelism with Controllable Memory" (Qi et al., NeurIPS 2024) shows that on the V
placement (rank r holds stages r and 2p-1-r, each half a 1F1B stage) a micro-batch's activations live
on a rank only while it travels down and back up the V past that rank, so the memory a rank needs is
set by how many micro-batches are let in at once, not by p: V-Half holds about half of 1F1B's
activations (ceil(p/2)+1 stage-micro-batches) at a smaller bubble than 1F1B's, V-Min about a third
(ceil(p/3)+1) at a bubble like 1F1B's.

How: a budget per rank, in bytes where the stages' memory is measured: `in_flight` / p (by default
the paper's ceil(p/2)+1 or ceil(p/3)+1 over p) of what 1F1B holds on its fullest rank on the same
layers (two V stages make one 1F1B stage), counted as the simulator counts it (from an F to its I
the stage's activations, from the I to its W what the I leaves: with a split backward often more).
So every rank, the ones holding the embedding or the head too, stays within the promise in bytes,
whatever the stages weigh. Unmeasured (unit costs), the budget counts chunk-micro-batches: twice the
stage-micro-batches, two chunks making one. Two kinds of critical order (F and I per rank) are
tried, and `weight_fill` splits each backward and places its W under the budget; the fastest is
kept:

- the paper's building block: one micro-batch's passes laid out as tight as the costs allow (down
  the V forward, back up with the input gradients), repeated every period (the busiest rank's work
  for one micro-batch), each rank running its passes in the order of their times. The tight block
  alone holds about a third of 1F1B's activations (V-Min); the first micro-batches are let in
  faster than the period (up to `front` periods ahead, a rank's forwards apart) where the budget
  has room, which fills the warm-up (V-Half);
- a greedy play-through on the measured costs (`zero_bubble.list_schedule`, full backward) with a
  count budget shared between the rank's two chunks in proportion to how long each keeps a
  micro-batch (chunk 0 of rank r: the trip through 2(2p-1-r)+1 stages; chunk 1: 2r+1), which wins
  on short pipelines. Under a budget in bytes the count is a guess, so counts from the paper's
  down to half of it are tried (and the building block's fronts in half periods).

A budget no order meets (one rank's two stages heavier than the share allows) falls back to that
rank's own micro-batches (`in_flight` times its two stages' activations), then to the count: the
schedule holds its promise in micro-batches where the bytes cannot. More micro-batches in flight buy a
smaller bubble: that is `in_flight` (or plan=auto's variants of it), never the default.
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
    ScheduleCosts,
    ScheduleGenerator,
    require_microbatches_at_least,
)
from pipelaunch.pipeline.planner.schedules.weight_fill import StageCosts, StageMemory
from pipelaunch.pipeline.planner.schedules.zero_bubble import ALPHAS, list_schedule

#: memory -> the divisor of p: the most stage-micro-batches a rank holds is ceil(p / divisor) + 1
DIVISORS = {"half": 2, "min": 3}


def stage_microbatches(pp: int, memory: str) -> int:
    """The paper's budget: ceil(p / divisor) + 1 stage-micro-batches per rank (ceil((p+2)/2) for
    V-Half, ceil((p+4)/3) for V-Min)."""
    return math.ceil(pp / DIVISORS[memory]) + 1


def budget_chunks(pp: int, memory: str, in_flight: int | None = None) -> int:
    """The chunk-micro-batches a rank may hold: twice its stage-micro-batches."""
    return 2 * (in_flight if in_flight is not None else stage_microbatches(pp, memory))


def byte_budgets(placement: list[int], memory: StageMemory, in_flight: int) -> list[list[float]]:
    """The per-rank caps in bytes to try, tightest first: `in_flight` / p of what 1F1B holds on its
    fullest rank on the same layers (its rank r runs V stages 2r and 2r + 1 as one stage and holds
    p - r micro-batches of it); then, where a rank's own two stages weigh more than that share
    allows, `in_flight` of its own micro-batches."""
    pp = max(placement) + 1
    act = memory.forward
    one_f_one_b = max((pp - r) * (act[2 * r] + act[2 * r + 1]) for r in range(pp))
    share = in_flight * one_f_one_b / pp
    own = [0.0] * pp
    for s, r in enumerate(placement):
        own[r] += act[s]
    caps = [[share] * pp]
    if any(in_flight * o > share for o in own):
        caps.append([max(share, in_flight * o) for o in own])
    return caps


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


def fronts(pp: int, budget: int, fine: bool = False) -> list[float]:
    """How many periods ahead to let the first micro-batches in, most promising first: about half the
    budget the tight block leaves unused (it holds about (4p + 1) / 6 chunk-micro-batches a rank).
    `fine`: also every half period from one above the guess down to 0 (a budget in bytes, where
    the count is only a guess)."""
    guess = max(0, int((budget - (4 * pp + 1) / 6) // 2))
    out = [f for f in (guess, guess - 1, guess + 1, guess - 2, 0) if f >= 0]
    if fine:
        out += [h / 2 for h in range(2 * guess + 2, -1, -1)]
    return list(dict.fromkeys(float(f) for f in out))


@dataclass(frozen=True)
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
    #: run an I and its W as one fused B wherever the simulated step does not grow (schedules/fuse.py)
    fuse_backward: bool = True
    #: stage-micro-batches of activations a rank may hold; None: the paper's ceil(p/2)+1 (V-Min's
    #: ceil(p/3)+1). More cut the bubble at the price of the memory the schedule is named for
    in_flight: int | None = None

    def stages_per_rank(self) -> int:
        return 2

    def check(self, pp: int, microbatches: int, placement: list[int]) -> None:
        if list(placement) != v_shape(pp):
            raise ConfigError("placement", f"scheduler {self.name!r} needs the V placement {v_shape(pp)} "
                                           f"(placement=v or auto), got {placement}")
        require_microbatches_at_least(self.name, microbatches, 1, "it needs at least one micro-batch")
        if self.in_flight is not None and (isinstance(self.in_flight, bool) or not isinstance(self.in_flight, int)
                                           or self.in_flight < 1):
            raise ConfigError("scheduler.in_flight", f"got {self.in_flight!r}; valid: null (the paper's "
                                                     f"{stage_microbatches(pp, self.memory)} at pp={pp}) or an "
                                                     "integer >= 1 (micro-batches of activations per rank)")

    def compute_actions(self, placement: list[int], microbatches: int, costs: ScheduleCosts | None = None,
                        *, first_order: bool = False) -> list[list[Action]]:
        """The fastest order under the tightest budget some order meets (module docstring)."""
        pp = max(placement) + 1
        stage_mbs = self.in_flight if self.in_flight is not None else stage_microbatches(pp, self.memory)
        memory = self.stage_memory(costs)
        budgets = [(cap, memory) for cap in byte_budgets(placement, memory, stage_mbs)] if memory is not None else []
        budgets.append(([budget_chunks(pp, self.memory, stage_mbs)] * pp, None))
        error: ConfigError | None = None
        for cap, held in budgets:
            try:
                return self.best_filled(self._candidates(placement, microbatches, cap, held, costs), placement,
                                        microbatches, costs, first_order)
            except ConfigError as err:
                error = error or err
        assert error is not None
        raise error

    def _candidates(self, placement: list[int], microbatches: int, cap: list[float], memory: StageMemory | None,
                    costs: ScheduleCosts | None) -> Iterator[Candidate]:
        """The building block's orders first (each front, W placed two ways), then the greedy
        play-throughs, built only when `best_filled` gets to them (they are the slower to make).
        The orders' own micro-batch counts come from the count budget; `cap` is what the W are
        placed under (in bytes as `memory` prices them, else in micro-batches)."""
        pp = max(placement) + 1
        budget = budget_chunks(pp, self.memory, self.in_flight)
        priced = self.stage_costs(len(placement), costs)
        for front in fronts(pp, budget, fine=memory is not None):
            order = block_order(placement, microbatches, priced, front)
            yield from (Candidate(order, cap, alpha, memory=memory) for alpha in ALPHAS[:2])
        # under bytes, the play-through's count is a guess: from the budget's down to half of it
        counts = range(budget, max(2, budget // 2) - 1, -1) if memory is not None else (budget,)
        for count, shift in ((c, k) for c in counts for k in (0, -1, 1)):
            try:
                order = self.play_through(list_schedule, placement, microbatches, costs, split_backward=False,
                                          cap=[count] * pp, stage_cap=stage_caps(pp, count, shift),
                                          forward_first=False)
            except ConfigError:
                continue
            critical = [[I(a.stage, a.mb) if a.kind is Kind.B else a for a in acts] for acts in order]
            yield from (Candidate(critical, cap, alpha, memory=memory) for alpha in ALPHAS)


@dataclass(frozen=True)
class VMin(VHalf):
    """V-Min: at most ceil(p/3)+1 stage-micro-batches of activations per rank."""

    name: ClassVar[str] = "v_min"
    memory: ClassVar[str] = "min"
